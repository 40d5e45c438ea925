// Native reference for tools/bench/bench_core.py: the same workloads as the Python side, written
// against llama.h only, linked against the very libllama the package loads.
//
//   native_driver MODEL WORKLOAD [key=value ...]      -> one JSON line on stdout
//
// WORKLOAD: decode | parallel | prefill | fill | state. Keys (all optional, bench_core.py passes
// every one explicitly so both sides run with the same settings): threads, n_ctx, n_batch,
// n_ubatch, n_seq_max, kv_unified, n_predict, n_parallel, n_tokens, iters, warmup, prompt.
// Timings are CLOCK_MONOTONIC (what Python's time.perf_counter reads on Linux).
#include "llama.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

// -- settings ------------------------------------------------------------------------------------
static struct {
    int threads, n_ctx, n_batch, n_ubatch, n_seq_max, kv_unified;
    int n_predict, n_parallel, n_tokens, iters, warmup;
    const char * prompt;
} S = {2, 1024, 512, 512, 1, 0, 256, 8, 512, 5, 1, "Once upon a time"};

static void parse_kv(const char * arg) {
    const char * eq = strchr(arg, '=');
    if (!eq) { fprintf(stderr, "bad argument %s (want key=value)\n", arg); exit(2); }
    size_t k = (size_t)(eq - arg);
    const char * v = eq + 1;
#define INT_KEY(name) if (k == strlen(#name) && !strncmp(arg, #name, k)) { S.name = atoi(v); return; }
    INT_KEY(threads) INT_KEY(n_ctx) INT_KEY(n_batch) INT_KEY(n_ubatch) INT_KEY(n_seq_max)
    INT_KEY(kv_unified) INT_KEY(n_predict) INT_KEY(n_parallel) INT_KEY(n_tokens) INT_KEY(iters)
    INT_KEY(warmup)
#undef INT_KEY
    if (k == 6 && !strncmp(arg, "prompt", 6)) { S.prompt = v; return; }
    fprintf(stderr, "unknown key in %s\n", arg);
    exit(2);
}

// -- log: silent; only the flash-attention verdict is picked out while the context is created ----
static int  g_watch_log = 0;
static char g_flash_attn[32] = "unknown";

static void log_cb(enum ggml_log_level level, const char * text, void * ud) {
    (void) level; (void) ud;
    if (!g_watch_log) return;  // the timed parts run with this no-op
    if (strstr(text, "Flash Attention")) {
        if (strstr(text, "enabled"))       snprintf(g_flash_attn, sizeof g_flash_attn, "enabled");
        else if (strstr(text, "disabled")) snprintf(g_flash_attn, sizeof g_flash_attn, "disabled");
    }
}

// -- helpers -------------------------------------------------------------------------------------
static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double) ts.tv_sec + 1e-9 * (double) ts.tv_nsec;
}

static void die(const char * what) { fprintf(stderr, "native_driver: %s\n", what); exit(1); }

static int cmp_double(const void * a, const void * b) {
    double x = *(const double *) a, y = *(const double *) b;
    return (x > y) - (x < y);
}

static double median(double * v, int n) {
    qsort(v, (size_t) n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static void print_list(const char * key, const double * v, int n) {
    printf(", \"%s\": [", key);
    for (int i = 0; i < n; i++) printf("%s%.9g", i ? ", " : "", v[i]);
    printf("]");
}

static void batch_add(struct llama_batch * b, llama_token tok, llama_pos pos, const llama_seq_id * ids, int n_ids,
                      int logits) {
    int i = b->n_tokens;
    b->token[i] = tok;
    b->pos[i] = pos;
    b->n_seq_id[i] = n_ids;
    for (int j = 0; j < n_ids; j++) b->seq_id[i][j] = ids[j];
    b->logits[i] = (int8_t) logits;
    b->n_tokens = i + 1;
}

// The synthetic prompt of prefill/fill/state, the same formula as bench_core.py's synthetic_tokens().
static llama_token synth(int i, int n_vocab) { return (llama_token) ((1000 + 37L * i) % n_vocab); }

static struct llama_model * g_model;
static const struct llama_vocab * g_vocab;

static struct llama_context * make_ctx(int n_seq_max, int kv_unified) {
    struct llama_context_params p = llama_context_default_params();
    p.n_ctx = (uint32_t) S.n_ctx;
    p.n_batch = (uint32_t) S.n_batch;
    p.n_ubatch = (uint32_t) S.n_ubatch;
    p.n_seq_max = (uint32_t) n_seq_max;
    p.n_threads = p.n_threads_batch = S.threads;
    p.kv_unified = kv_unified != 0;  // flash_attn_type stays LLAMA_FLASH_ATTN_TYPE_AUTO
    g_watch_log = 1;
    struct llama_context * ctx = llama_init_from_model(g_model, p);
    g_watch_log = 0;
    if (!ctx) die("llama_init_from_model failed");
    return ctx;
}

static int tokenize(const char * text, llama_token * out, int cap) {
    int n = llama_tokenize(g_vocab, text, (int32_t) strlen(text), out, cap, true, false);
    if (n < 0) die("prompt too long");
    return n;
}

static struct llama_sampler * greedy(void) {
    struct llama_sampler_chain_params sp = llama_sampler_chain_default_params();
    sp.no_perf = true;
    struct llama_sampler * s = llama_sampler_chain_init(sp);
    llama_sampler_chain_add(s, llama_sampler_init_greedy());
    return s;
}

static uint32_t checksum(const llama_token * t, int n) {  // the same as bench_core.py's checksum()
    uint32_t h = 2166136261u;
    for (int i = 0; i < n; i++) { h ^= (uint32_t) t[i]; h *= 16777619u; }
    return h;
}

// -- 1. decode: prompt, then n_predict greedy tokens, one llama_decode each (pl.generate's loop) --
static double run_decode(struct llama_context * ctx, struct llama_sampler * smpl, const llama_token * prompt,
                         int n_prompt, int n_predict, llama_token * out, int * n_out, int * n_decoded) {
    const llama_seq_id s0 = 0;
    struct llama_batch pb = llama_batch_init(S.n_batch, 0, 1);
    for (int i = 0; i < n_prompt; i++) batch_add(&pb, prompt[i], i, &s0, 1, i == n_prompt - 1);
    if (llama_decode(ctx, pb) != 0) die("prompt decode failed");
    double t0 = now_s();  // decode phase: from the end of the prompt's decode
    struct llama_batch b = llama_batch_init(1, 0, 1);
    int pos = n_prompt, nd = 0, no = 0;
    for (int i = 0; i < n_predict; i++) {
        llama_token tok = llama_sampler_sample(smpl, ctx, -1);
        out[no++] = tok;
        if (llama_vocab_is_eog(g_vocab, tok)) break;
        b.n_tokens = 0;
        batch_add(&b, tok, pos, &s0, 1, 1);
        if (llama_decode(ctx, b) != 0) die("decode failed");
        nd++;
        pos++;
    }
    double t = now_s() - t0;
    llama_batch_free(b);
    llama_batch_free(pb);
    *n_out = no;
    *n_decoded = nd;
    return t;
}

// run_decode on a caller's context and sampler, exported like state_step below: bench_core.py runs
// it in the Python worker's process, on the context pl.generate decodes with, alternating the two.
// Returns the decode phase's seconds; *n_decoded and *sum (checksum of the sampled tokens) as
// wl_decode reports them.
double decode_in_process(struct llama_context * ctx, struct llama_sampler * smpl, const llama_token * prompt,
                         int n_prompt, int n_predict, int * n_decoded, uint32_t * sum) {
    g_vocab = llama_model_get_vocab(llama_get_model(ctx));
    llama_token * out = malloc(sizeof(llama_token) * (size_t) (n_predict > 0 ? n_predict : 1));
    int n_out = 0;
    double t = run_decode(ctx, smpl, prompt, n_prompt, n_predict, out, &n_out, n_decoded);
    *sum = checksum(out, n_out);
    free(out);
    return t;
}

static int wl_decode(void) {
    struct llama_context * ctx = make_ctx(1, 0);
    struct llama_sampler * smpl = greedy();
    enum { N_WARMUP = 16 };  // the warm-up's tokens land in out too: room for the larger run
    size_t n_out_max = (size_t) (S.n_predict > N_WARMUP ? S.n_predict : N_WARMUP);
    llama_token prompt[512], *out = malloc(sizeof(llama_token) * n_out_max);
    int n_prompt = tokenize(S.prompt, prompt, 512), n_out, n_dec;
    if (S.warmup) {
        run_decode(ctx, smpl, prompt, n_prompt, N_WARMUP, out, &n_out, &n_dec);
        llama_memory_clear(llama_get_memory(ctx), true);
        llama_sampler_reset(smpl);
    }
    double t = run_decode(ctx, smpl, prompt, n_prompt, S.n_predict, out, &n_out, &n_dec);
    printf("{\"workload\": \"decode\", \"flash_attn\": \"%s\", \"n_prompt\": %d, \"n_decoded\": %d, "
           "\"t_s\": %.9g, \"tok_s\": %.6g, \"checksum\": %u}\n",
           g_flash_attn, n_prompt, n_dec, t, n_dec / t, checksum(out, n_out));
    free(out);
    llama_sampler_free(smpl);
    llama_free(ctx);
    return 0;
}

// -- 2. parallel: examples/batched, the flow of pl.generate_parallel step for step --------------
static double run_parallel(struct llama_context * ctx, struct llama_sampler * smpl, const llama_token * prompt,
                           int n_prompt, int np, int n_predict, llama_token * toks /* np x n_predict */,
                           int * n_toks, int * n_decoded) {
    llama_seq_id ids[64];
    int cap = S.n_batch > np ? S.n_batch : np;
    struct llama_batch b = llama_batch_init(cap, 0, S.n_seq_max);
    for (int s = 0; s < np; s++) ids[s] = s;
    for (int i = 0; i < n_prompt; i++) batch_add(&b, prompt[i], i, ids, np, i == n_prompt - 1);
    if (llama_decode(ctx, b) != 0) die("prompt decode failed");
    double t0 = now_s();  // decode phase: from the end of the prompt's decode
    int out_index[64], live[64], n_live = np, nd = 0, pos = n_prompt;
    for (int s = 0; s < np; s++) { out_index[s] = b.n_tokens - 1; live[s] = s; n_toks[s] = 0; }
    for (int step = 0; step < n_predict; step++) {
        b.n_tokens = 0;
        int still = 0;
        for (int k = 0; k < n_live; k++) {
            int s = live[k];
            llama_token tok = llama_sampler_sample(smpl, ctx, out_index[s]);
            toks[s * n_predict + n_toks[s]++] = tok;
            if (llama_vocab_is_eog(g_vocab, tok) || n_toks[s] >= n_predict) continue;
            out_index[s] = b.n_tokens;
            batch_add(&b, tok, pos, &ids[s], 1, 1);
            live[still++] = s;
        }
        n_live = still;
        if (!n_live) break;
        nd += b.n_tokens;
        if (llama_decode(ctx, b) != 0) die("decode failed");
        pos++;
    }
    char text[1 << 16];  // pl.generate_parallel detokenizes every sequence before it returns
    for (int s = 0; s < np; s++) {
        int n = n_toks[s];
        if (n && llama_vocab_is_eog(g_vocab, toks[s * n_predict + n - 1])) n--;
        llama_detokenize(g_vocab, &toks[s * n_predict], n, text, sizeof text, false, false);
    }
    double t = now_s() - t0;
    llama_batch_free(b);
    *n_decoded = nd;
    return t;
}

static int wl_parallel(void) {
    int np = S.n_parallel;
    if (np > 64 || np > S.n_seq_max) die("n_parallel must be <= n_seq_max and <= 64");
    struct llama_context * ctx = make_ctx(S.n_seq_max, S.kv_unified);
    struct llama_sampler * smpl = greedy();  // one sampler for all sequences, as generate_parallel
    llama_token prompt[512], *toks = malloc(sizeof(llama_token) * (size_t) (np * S.n_predict));
    int n_toks[64], n_prompt = tokenize(S.prompt, prompt, 512), nd;
    if (S.warmup) {
        run_parallel(ctx, smpl, prompt, n_prompt, np, 4, toks, n_toks, &nd);
        llama_memory_clear(llama_get_memory(ctx), true);
        llama_sampler_reset(smpl);
    }
    double t = run_parallel(ctx, smpl, prompt, n_prompt, np, S.n_predict, toks, n_toks, &nd);
    uint32_t h = 0;
    for (int s = 0; s < np; s++) h = h * 31u + checksum(&toks[s * S.n_predict], n_toks[s]);
    printf("{\"workload\": \"parallel\", \"flash_attn\": \"%s\", \"n_prompt\": %d, \"n_decoded\": %d, "
           "\"t_s\": %.9g, \"tok_s\": %.6g, \"checksum\": %u}\n", g_flash_attn, n_prompt, nd, t, nd / t, h);
    free(toks);
    llama_sampler_free(smpl);
    llama_free(ctx);
    return 0;
}

// -- 3. prefill: n_tokens in one llama_decode, logits of the last -------------------------------
static int wl_prefill(void) {
    struct llama_context * ctx = make_ctx(1, 0);
    int n = S.n_tokens, nv = llama_vocab_n_tokens(g_vocab);
    const llama_seq_id s0 = 0;
    struct llama_batch b = llama_batch_init(S.n_batch, 0, 1);
    double * ts = malloc(sizeof(double) * (size_t) (S.iters + 1));
    for (int it = -S.warmup; it < S.iters; it++) {
        llama_memory_clear(llama_get_memory(ctx), true);
        double t0 = now_s();
        b.n_tokens = 0;
        for (int i = 0; i < n; i++) batch_add(&b, synth(i, nv), i, &s0, 1, i == n - 1);
        if (llama_decode(ctx, b) != 0) die("prefill decode failed");
        llama_synchronize(ctx);
        double t = now_s() - t0;
        if (it >= 0) ts[it] = t;
    }
    printf("{\"workload\": \"prefill\", \"flash_attn\": \"%s\", \"n_tokens\": %d", g_flash_attn, n);
    print_list("t_s", ts, S.iters);
    double m = median(ts, S.iters);
    printf(", \"t_median_s\": %.9g, \"tok_s\": %.6g}\n", m, n / m);
    free(ts);
    llama_batch_free(b);
    llama_free(ctx);
    return 0;
}

// -- 4. fill: a 2048-token llama_batch filled by a plain C loop (no decode) ---------------------
static int wl_fill(void) {
    int n = S.n_tokens, nv = llama_vocab_n_tokens(g_vocab);
    const llama_seq_id s0 = 0;
    llama_token * toks = malloc(sizeof(llama_token) * (size_t) n);
    for (int i = 0; i < n; i++) toks[i] = synth(i, nv);
    struct llama_batch b = llama_batch_init(n, 0, 1);
    double * ts = malloc(sizeof(double) * (size_t) S.iters);
    for (int it = -100; it < S.iters; it++) {
        double t0 = now_s();
        b.n_tokens = 0;
        for (int i = 0; i < n; i++) batch_add(&b, toks[i], i, &s0, 1, i == n - 1);
        double t = now_s() - t0;
        if (it >= 0) ts[it] = t;
    }
    double best = ts[0];
    for (int i = 1; i < S.iters; i++) best = ts[i] < best ? ts[i] : best;
    printf("{\"workload\": \"fill\", \"n_tokens\": %d, \"iters\": %d, \"n_filled\": %d, \"best_us\": %.6g, "
           "\"median_us\": %.6g}\n", n, S.iters, b.n_tokens, best * 1e6, median(ts, S.iters) * 1e6);
    free(ts);
    llama_batch_free(b);
    free(toks);
    return 0;
}

// -- 5. state: get / set of one n_tokens-token sequence --------------------------------------
// The timed core of wl_state's first loop: size, a fresh buffer, the copy (what ctx.seq_state
// does), then the set into seq 0, which still holds it (llama.cpp removes it first). Returns the
// buffer (the caller frees it; page_offset: where malloc put it in its page) or NULL on a short
// get or a failed set. Exported: bench_core.py also
// loads this file built as a shared library and runs it on the Python side's own context, in its
// process, so that both sides copy from the same KV tensors (see bench_core.py, "in-process").
uint8_t * state_get_set(struct llama_context * ctx, size_t * size, double * t_get, double * t_set,
                        unsigned * page_offset) {
    double t0 = now_s();
    *size = llama_state_seq_get_size_ext(ctx, 0, 0);
    uint8_t * buf = malloc(*size);
    *page_offset = (unsigned) ((uintptr_t) buf % 4096);
    size_t w = llama_state_seq_get_data_ext(ctx, buf, *size, 0, 0);
    double t1 = now_s();
    if (w != *size || llama_state_seq_set_data_ext(ctx, buf, *size, 0, 0) == 0) {
        free(buf);
        return NULL;
    }
    *t_get = t1 - t0;
    *t_set = now_s() - t1;
    return buf;
}

// state_get_set, then free: one step for bench_core.py's in-process loop. 0 on success.
int state_step(struct llama_context * ctx, double * t_get, double * t_set, unsigned * page_offset) {
    size_t size;
    uint8_t * buf = state_get_set(ctx, &size, t_get, t_set, page_offset);
    if (!buf) return -1;
    free(buf);
    return 0;
}

static int wl_state(void) {
    struct llama_context * ctx = make_ctx(1, 0);
    llama_memory_t mem = llama_get_memory(ctx);
    int n = S.n_tokens, nv = llama_vocab_n_tokens(g_vocab);
    const llama_seq_id s0 = 0;
    struct llama_batch b = llama_batch_init(S.n_batch, 0, 1);
    for (int i = 0; i < n; i++) batch_add(&b, synth(i, nv), i, &s0, 1, i == n - 1);
    if (llama_decode(ctx, b) != 0) die("prefill decode failed");
    int N = S.iters;
    double * tg = malloc(sizeof(double) * (size_t) N * 3), *ts = tg + N, *te = tg + 2 * N;
    size_t size = 0;
    unsigned page_offset = 0;  // where malloc put the buffer in its page (the copy's speed depends on it)
    for (int it = -S.warmup; it < N; it++) {
        double t_get, t_set;
        uint8_t * buf = state_get_set(ctx, &size, &t_get, &t_set, &page_offset);
        if (!buf) die("state get / set failed");
        // set into the emptied sequence
        llama_memory_seq_rm(mem, 0, -1, -1);
        double t3 = now_s();
        if (llama_state_seq_set_data_ext(ctx, buf, size, 0, 0) == 0) die("set_data_ext failed");
        double t4 = now_s();
        free(buf);
        if (it >= 0) { tg[it] = t_get; ts[it] = t_set; te[it] = t4 - t3; }
    }
    // The copy's speed depends on where the destination sits in its page (relative to the KV
    // tensors it is copied from): the same get / set with the dump at page offsets 0, 512 ... 3584
    // of one buffer, which bench_core.py's Python side repeats with seq_state(out=).
    const double get_ms = median(tg, N) * 1e3, set_ms = median(ts, N) * 1e3, set_empty_ms = median(te, N) * 1e3;
    // The same get (size, then data) and set as the first loop, with the dump placed at page offset
    // 0, 512 ... 3584 of one buffer instead of where malloc puts it.
    enum { N_PLACE = 8 };
    double pg[N_PLACE], ps[N_PLACE];
    uint8_t * big = malloc(size + 8192);
    for (int k = 0; k < N_PLACE; k++) {
        uint8_t * p = big + ((uintptr_t) (512 * k) - (uintptr_t) big) % 4096;
        for (int it = -S.warmup; it < N; it++) {
            double t0 = now_s();
            if (llama_state_seq_get_size_ext(ctx, 0, 0) != size) die("the state changed size");
            if (llama_state_seq_get_data_ext(ctx, p, size, 0, 0) != size) die("get_data_ext wrote a short state");
            double t1 = now_s();
            if (llama_state_seq_set_data_ext(ctx, p, size, 0, 0) == 0) die("set_data_ext failed");
            double t2 = now_s();
            if (it >= 0) { tg[it] = t1 - t0; ts[it] = t2 - t1; }
        }
        pg[k] = median(tg, N) * 1e3;
        ps[k] = median(ts, N) * 1e3;
    }
    free(big);
    printf("{\"workload\": \"state\", \"n_tokens\": %d, \"state_bytes\": %zu, \"flash_attn\": \"%s\"", n, size,
           g_flash_attn);
    printf(", \"get_ms\": %.6g, \"set_ms\": %.6g, \"set_empty_ms\": %.6g, \"buf_page_offset\": %u", get_ms, set_ms,
           set_empty_ms, page_offset);
    printf(", \"place_get_ms\": [");
    for (int k = 0; k < N_PLACE; k++) printf("%s%.6g", k ? ", " : "", pg[k]);
    printf("], \"place_set_ms\": [");
    for (int k = 0; k < N_PLACE; k++) printf("%s%.6g", k ? ", " : "", ps[k]);
    printf("]}\n");
    free(tg);
    llama_batch_free(b);
    llama_free(ctx);
    return 0;
}

int main(int argc, char ** argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s MODEL decode|parallel|prefill|fill|state [key=value ...]\n", argv[0]);
        return 2;
    }
    for (int i = 3; i < argc; i++) parse_kv(argv[i]);
    llama_log_set(log_cb, NULL);  // before anything else logs
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    g_model = llama_model_load_from_file(argv[1], mp);
    if (!g_model) die("cannot load the model");
    g_vocab = llama_model_get_vocab(g_model);
    const char * w = argv[2];
    int rc = !strcmp(w, "decode")   ? wl_decode()
           : !strcmp(w, "parallel") ? wl_parallel()
           : !strcmp(w, "prefill")  ? wl_prefill()
           : !strcmp(w, "fill")     ? wl_fill()
           : !strcmp(w, "state")    ? wl_state()
           : (fprintf(stderr, "unknown workload %s\n", w), 2);
    fflush(stdout);
    llama_model_free(g_model);
    llama_backend_free();
    return rc;
}
