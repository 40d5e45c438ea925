/* Graph taps: the eval callback (cb_eval, ggml_backend_sched_eval_callback) of every context that
 * pyllamacpp makes, answered in C (pyllamacpp/taps.py is the Python side).
 *
 * The scheduler asks ask=true for each graph node before computing it; a node it is told it is
 * wanted ends a graph view, is computed, synchronized, then shown again with ask=false. So the
 * ask=true answer must cost almost nothing: one FNV-1a hash of the node's name and a probe of an
 * open-addressing table of the wanted names (the exact names and occurrences Python resolved from
 * a listing of the graph). A wanted node is copied here, with ggml_backend_tensor_get (any
 * backend), into an arena Python owns; a patched node calls Python (the one trampoline below).
 * Inputs (graph leaves: the KQ mask, positions, token ids, the KV cache tensors) never reach the
 * callback: they are read, once per pass, from the src[] of the first node that reads them, at
 * ask=true (set before the compute starts, so no split is needed for them).
 *
 * A failure (arena or record table full, a Python exception, a node that is not what the listing
 * said) is kept in the state and stops the decode through the context's abort flag, so llama.cpp
 * rolls the ubatch back; Python raises it after llama_decode returns. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define PYL_TAP_NAME 64 /* GGML_MAX_NAME */
#define PYL_TAP_OCC 16  /* nodes (or distinct leaves) of one name a want can tell apart */

enum {
    PYL_TAP_CAPTURE = 1, /* copy the node (or input) into the arena */
    PYL_TAP_PATCH = 2,   /* call Python with the node (before the copy, if both) */
    PYL_TAP_INPUT = 4,   /* a leaf, read through the src[] of the node that reads it */
    PYL_TAP_META = 8,    /* a record without the data (shapes, passes): the split, not the copy */
};

enum { /* pyl_tap_record.flags */
    PYL_TAPREC_INPUT = 1,      /* a leaf read through src[] before its reader computed */
    PYL_TAPREC_NO_DATA = 2,    /* the tensor had no buffer or data: nothing copied */
    PYL_TAPREC_CONTIGUOUS = 4, /* ggml_is_contiguous */
};

enum { /* pyl_taps.error */
    PYL_TAPERR_ARENA = 1,
    PYL_TAPERR_RECORDS = 2,
    PYL_TAPERR_CALLS = 3,
    PYL_TAPERR_OP = 4,
    PYL_TAPERR_PYTHON = 5,
};

/* One wanted name. A name is not unique: modes[k] says what to do with the k-th node of that
 * name in a pass (graph order), or for an input the k-th distinct leaf of that name (an iSWA
 * model's two KQ masks are both attn_inp_kq_mask). */
typedef struct {
    char name[PYL_TAP_NAME];
    int32_t modes[PYL_TAP_OCC]; /* PYL_TAP_* bits per occurrence, 0: not wanted */
    int32_t ops[PYL_TAP_OCC];   /* the op the listing showed there (-1: any) */
    int32_t input;              /* a leaf: read through src[] */
    int32_t seen;               /* nodes of that name seen this pass (reset at each pass start) */
    const void *leaves[PYL_TAP_OCC]; /* inputs: the distinct leaves of that name seen this pass */
    int32_t n_leaves;
    int32_t done_mask;          /* inputs: occurrences handled this pass */
    int64_t n_hits;             /* copies or patches made */
} pyl_tap_want;

typedef struct {
    int32_t want;       /* index into wants */
    int32_t occurrence; /* which node (or leaf) of that name */
    int32_t call;    /* decode call, counted from the capture's start */
    int32_t pass_no; /* forward pass (ubatch), counted from the capture's start */
    int32_t op, type, flags;
    int64_t ne[4];
    uint64_t nb[4];
    uint64_t offset, nbytes; /* where the copy lies in the arena */
    char name[PYL_TAP_NAME];
    char buffer[PYL_TAP_NAME]; /* ggml_backend_buffer_name of the tensor's buffer ("" none) */
    uint64_t buffer_offset;    /* the tensor's data - ggml_backend_buffer_get_base */
    uint64_t buffer_size;      /* ggml_backend_buffer_get_size */
    int32_t buffer_usage;      /* enum ggml_backend_buffer_usage */
    int32_t is_host;           /* ggml_backend_buffer_is_host */
} pyl_tap_record;

typedef struct {
    int32_t first_pass; /* passes counted before this call started */
    int32_t n_rows;     /* rows the C generation step decoded (1), or 0: Python knows the batch */
    int32_t token, pos, seq_id;
} pyl_tap_call;

typedef struct {
    int32_t armed; /* 0: every node is answered "not wanted" after one load */
    pyl_tap_want *wants;
    int32_t n_wants, n_input_wants;
    int32_t *table; /* hash slots: want index + 1, 0 empty */
    uint32_t table_mask;
    uint32_t pass_start_hash;
    char pass_start[PYL_TAP_NAME]; /* the graph's first node: a new pass begins there */
    uint8_t *arena;
    uint64_t arena_cap, arena_used, arena_need;
    pyl_tap_record *records;
    int32_t records_cap, n_records;
    pyl_tap_call *calls;
    int32_t calls_cap, n_calls;
    int32_t calls_ring;   /* patches only: every call goes to calls[0] (only the current one is read) */
    int32_t n_calls_total;
    int32_t cur_pass;     /* passes begun since the taps were armed, -1 before the first */
    int32_t inputs_left;  /* input wants not yet copied in this pass */
    int32_t pending;      /* the want whose ask=true was answered true, -1 none */
    int32_t pending_occ;  /* and which occurrence of its name */
    int32_t error;        /* PYL_TAPERR_*, 0 none */
    char error_name[PYL_TAP_NAME];
    int32_t error_op;
    int32_t error_pass;       /* the pass it happened in */
    int *abort_flag;          /* the context's pyl_abort_state.abort_requested */
    void *handle;             /* ffi.new_handle of the Python Taps object, for patches */
    int64_t n_asked;          /* ask=true calls while armed (for the cost figures) */
} pyl_taps;

static bool _pyllamacpp_tap_patch(struct ggml_tensor *, int32_t, int32_t, int32_t, void *); /* cffi defines it below */

static uint32_t pyl_tap_hash(const char *s) {
    uint32_t h = 2166136261u;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 16777619u;
    return h ? h : 1;
}

/* The table Python filled: the want of that exact name, or -1. */
static int32_t pyl_tap_find(const pyl_taps *s, const char *name, uint32_t h) {
    if (!s->table) return -1;
    for (uint32_t i = h & s->table_mask;; i = (i + 1) & s->table_mask) {
        int32_t w = s->table[i];
        if (w == 0) return -1;
        if (strncmp(s->wants[w - 1].name, name, PYL_TAP_NAME) == 0) return w - 1;
    }
}

/* Put want i into the table (Python calls this after filling wants; the table has room). */
static void pyl_tap_table_add(pyl_taps *s, int32_t i) {
    uint32_t h = pyl_tap_hash(s->wants[i].name);
    uint32_t j = h & s->table_mask;
    while (s->table[j] != 0) j = (j + 1) & s->table_mask;
    s->table[j] = i + 1;
}

static void pyl_tap_fail(pyl_taps *s, int32_t err, const struct ggml_tensor *t) {
    if (!s->error) {
        s->error = err;
        snprintf(s->error_name, PYL_TAP_NAME, "%s", t ? t->name : "");
        s->error_op = t ? (int32_t)t->op : -1;
        s->error_pass = s->cur_pass;
    }
    s->armed = 0;
    if (s->abort_flag) *s->abort_flag = 1; /* the next node computed aborts the ubatch */
}

static void pyl_tap_copy(pyl_taps *s, const struct ggml_tensor *t, int32_t want, int32_t occ, int32_t flags, int copy) {
    if (s->n_records >= s->records_cap) {
        pyl_tap_fail(s, PYL_TAPERR_RECORDS, t);
        return;
    }
    const size_t nbytes = ggml_nbytes(t);
    const uint64_t off = (s->arena_used + 63) & ~(uint64_t)63; /* aligned for any dtype */
    ggml_backend_buffer_t buf = t->view_src ? t->view_src->buffer : t->buffer;
    const int has_data = copy && buf != NULL && t->data != NULL && nbytes > 0;
    if (has_data && off + nbytes > s->arena_cap) {
        s->arena_need = off + nbytes;
        pyl_tap_fail(s, PYL_TAPERR_ARENA, t);
        return;
    }
    pyl_tap_record *r = &s->records[s->n_records++];
    r->want = want;
    r->occurrence = occ;
    r->call = s->n_calls - 1;
    r->pass_no = s->cur_pass;
    r->op = (int32_t)t->op;
    r->type = (int32_t)t->type;
    r->flags = flags | (has_data ? 0 : PYL_TAPREC_NO_DATA) | (ggml_is_contiguous(t) ? PYL_TAPREC_CONTIGUOUS : 0);
    for (int i = 0; i < 4; i++) {
        r->ne[i] = t->ne[i];
        r->nb[i] = t->nb[i];
    }
    memcpy(r->name, t->name, PYL_TAP_NAME);
    r->offset = off;
    r->nbytes = has_data ? nbytes : 0;
    r->buffer[0] = 0;
    r->buffer_offset = r->buffer_size = 0;
    r->buffer_usage = -1;
    r->is_host = 0;
    if (buf != NULL) {
        snprintf(r->buffer, PYL_TAP_NAME, "%s", ggml_backend_buffer_name(buf));
        const uint8_t *base = (const uint8_t *)ggml_backend_buffer_get_base(buf);
        r->buffer_offset = t->data ? (uint64_t)((const uint8_t *)t->data - base) : 0;
        r->buffer_size = ggml_backend_buffer_get_size(buf);
        r->buffer_usage = (int32_t)ggml_backend_buffer_get_usage(buf);
        r->is_host = ggml_backend_buffer_is_host(buf);
    }
    if (has_data) {
        if (ggml_backend_buffer_is_host(buf)) {
            memcpy(s->arena + off, t->data, nbytes);
        } else {
            ggml_backend_tensor_get(t, s->arena + off, 0, nbytes);
        }
        s->arena_used = off + nbytes;
    }
}

static void pyl_tap_new_pass(pyl_taps *s) {
    s->cur_pass++;
    for (int32_t i = 0; i < s->n_wants; i++) {
        s->wants[i].seen = 0;
        s->wants[i].n_leaves = 0;
        s->wants[i].done_mask = 0;
    }
    s->inputs_left = s->n_input_wants;
}

/* Inputs read by node t: handled once per pass, before t computes (their data is set by then). */
static void pyl_tap_inputs(pyl_taps *s, const struct ggml_tensor *t) {
    for (int i = 0; i < GGML_MAX_SRC && s->inputs_left > 0; i++) {
        const struct ggml_tensor *src = t->src[i];
        if (src == NULL) break;
        if (src->op != GGML_OP_NONE) continue;
        int32_t w = pyl_tap_find(s, src->name, pyl_tap_hash(src->name));
        if (w < 0 || !s->wants[w].input) continue;
        pyl_tap_want *wt = &s->wants[w];
        int32_t k = 0;
        while (k < wt->n_leaves && wt->leaves[k] != (const void *)src) k++;
        if (k == wt->n_leaves) {
            if (k >= PYL_TAP_OCC) continue;
            wt->leaves[wt->n_leaves++] = src;
        }
        const int32_t mode = wt->modes[k];
        if (!mode || (wt->done_mask & (1 << k))) continue;
        wt->done_mask |= 1 << k;
        wt->n_hits++;
        s->inputs_left--;
        if ((mode & PYL_TAP_PATCH) && !_pyllamacpp_tap_patch((struct ggml_tensor *)src, w, k, s->cur_pass, s->handle)) {
            pyl_tap_fail(s, PYL_TAPERR_PYTHON, src);
            return;
        }
        if (mode & (PYL_TAP_CAPTURE | PYL_TAP_META))
            pyl_tap_copy(s, src, w, k, PYL_TAPREC_INPUT, (mode & PYL_TAP_CAPTURE) != 0);
        if (s->error) return;
    }
}

static bool pyl_tap_eval(struct ggml_tensor *t, bool ask, void *user_data) {
    pyl_taps *s = (pyl_taps *)user_data;
    if (!s->armed) {
        /* After a failure, still count the passes that begin: a failure at a graph's last node
         * stops nothing in that pass, and Python removes its cells only when it sees that a later
         * pass began (the one the abort flag stopped, which llama.cpp rolled back itself). */
        if (s->error && ask && strncmp(t->name, s->pass_start, PYL_TAP_NAME) == 0) s->cur_pass++;
        return false;
    }
    if (ask) {
        s->n_asked++;
        const uint32_t h = pyl_tap_hash(t->name);
        if (h == s->pass_start_hash && strncmp(t->name, s->pass_start, PYL_TAP_NAME) == 0) pyl_tap_new_pass(s);
        if (s->inputs_left > 0) {
            pyl_tap_inputs(s, t);
            if (s->error) return false;
        }
        int32_t w = pyl_tap_find(s, t->name, h);
        if (w < 0 || s->wants[w].input) return false;
        pyl_tap_want *wt = &s->wants[w];
        const int32_t k = wt->seen++;
        if (k >= PYL_TAP_OCC || !wt->modes[k]) return false;
        if (wt->ops[k] >= 0 && wt->ops[k] != (int32_t)t->op) {
            pyl_tap_fail(s, PYL_TAPERR_OP, t);
            return false;
        }
        s->pending = w;
        s->pending_occ = k;
        return true;
    }
    const int32_t w = s->pending, k = s->pending_occ;
    s->pending = -1;
    if (w < 0) return true;
    pyl_tap_want *wt = &s->wants[w];
    const int32_t mode = wt->modes[k];
    wt->n_hits++;
    if (mode & PYL_TAP_PATCH) {
        if (!_pyllamacpp_tap_patch(t, w, k, s->cur_pass, s->handle)) {
            pyl_tap_fail(s, PYL_TAPERR_PYTHON, t);
            return true;
        }
    }
    if (mode & (PYL_TAP_CAPTURE | PYL_TAP_META)) pyl_tap_copy(s, t, w, k, 0, (mode & PYL_TAP_CAPTURE) != 0);
    return true;
}

/* A decode call begins (Context.decode, or the C generation step with its one row). */
static void pyl_taps_begin_call(pyl_taps *s, int32_t n_rows, llama_token token, llama_pos pos, llama_seq_id seq_id) {
    if (s == NULL || !s->armed) return;
    s->n_calls_total++;
    if (s->calls_ring && s->calls_cap > 0) s->n_calls = 0;
    if (s->n_calls >= s->calls_cap) {
        pyl_tap_fail(s, PYL_TAPERR_CALLS, NULL);
        return;
    }
    pyl_tap_call *c = &s->calls[s->n_calls++];
    c->first_pass = s->cur_pass + 1;
    c->n_rows = n_rows;
    c->token = token;
    c->pos = pos;
    c->seq_id = seq_id;
}

/* The C generation step (pyl_decode_sample in helpers.h): one row per call. */
static void pyl_taps_step(void *taps, llama_token token, llama_pos pos, llama_seq_id seq_id) {
    pyl_taps_begin_call((pyl_taps *)taps, 1, token, pos, seq_id);
}

/* For pyl_decode_sample: whether the taps failed during the step's decode. */
static int pyl_taps_failed(void *taps) { return ((pyl_taps *)taps)->error != 0; }
