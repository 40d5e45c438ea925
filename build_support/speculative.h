/* Forward passes counted in C, for speculative decoding's figures (pyllamacpp.speculative.PassCounter).
 *
 * A cb_eval (ggml_backend_sched_eval_callback) that wants no tensor. The scheduler asks it about
 * every graph node (ask=true) before computing; answering false for all of them leaves each split
 * computed in one go. A forward pass (one ubatch) starts where the graph's first node reappears,
 * the rule of experiments/trace.py's EvalTrace. In C because the default model's graph has about
 * 1,100 nodes per pass: a Python callback per node would take the GIL that often and slow the very
 * decodes it counts. */
#include <stdint.h>
#include <string.h>

typedef struct {
    char first[GGML_MAX_NAME]; /* the first node's name, from the first pass seen */
    int64_t n_passes;          /* graph computations (ubatches) seen */
    int64_t n_nodes;           /* nodes asked about, all passes */
} pyl_pass_count;

static bool pyl_pass_count_cb(struct ggml_tensor *t, bool ask, void *user_data) {
    pyl_pass_count *c = (pyl_pass_count *)user_data;
    if (!ask) return true; /* never reached: no node is wanted */
    c->n_nodes++;
    if (c->first[0] == '\0') {
        strncpy(c->first, t->name, sizeof c->first - 1);
        c->n_passes++;
    } else if (t->name[0] == c->first[0] && strcmp(t->name, c->first) == 0) {
        c->n_passes++;
    }
    return false;
}

/* the compiler checks that it has the type llama.cpp expects of cb_eval */
static ggml_backend_sched_eval_callback const pyl_pass_count_check = pyl_pass_count_cb;
