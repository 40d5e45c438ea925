/* pyllamacpp's own C helpers, compiled into the extension next to the generated binding.
 *
 * Abort without the GIL: llama.cpp calls the abort callback from its compute threads, often (per
 * graph node). A Python callback there would take the GIL each time and slow decoding down, so the
 * default abort callback is this C function reading a flag that Python sets (ctx.abort() from any
 * thread) or that a SIGINT handler sets while a decode runs on the main thread (Ctrl-C). */
#include <signal.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    volatile int abort_requested; /* set by Python: ctx.abort() */
    int watch_sigint;             /* this state also aborts on SIGINT while watched */
    void *taps;                   /* the context's pyl_taps while taps are armed (taps.h), else NULL */
} pyl_abort_state;

static void pyl_taps_step(void *taps, llama_token token, llama_pos pos, llama_seq_id seq_id); /* taps.h */
static int pyl_taps_failed(void *taps);                                                        /* taps.h */
#define PYL_STEP_TAPS_FAILED 1000 /* pyl_step_out.rc: the decode succeeded but a tap failed in it */

static volatile sig_atomic_t pyl_sigint_seen = 0;
static struct sigaction pyl_old_sigint;
static int pyl_sigint_installed = 0;

static bool pyl_abort_flag_cb(void *data) {
    pyl_abort_state *s = (pyl_abort_state *)data;
    return s->abort_requested || (s->watch_sigint && pyl_sigint_seen);
}

static void pyl_on_sigint(int sig) {
    (void)sig;
    pyl_sigint_seen = 1; /* swallowed: the decode returns 2 and Python raises DecodeAborted */
}

/* Call on the main thread only, around one decode. Returns 1 if installed. A process that
 * ignores SIGINT (SIG_IGN, e.g. a background job) keeps ignoring it: no watch then. */
static int pyl_sigint_watch(void) {
    struct sigaction sa, cur;
    if (pyl_sigint_installed) return 0;
    if (sigaction(SIGINT, NULL, &cur) != 0 || cur.sa_handler == SIG_IGN) return 0;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = pyl_on_sigint;
    sigemptyset(&sa.sa_mask);
    pyl_sigint_seen = 0;
    if (sigaction(SIGINT, &sa, &pyl_old_sigint) != 0) return 0;
    pyl_sigint_installed = 1;
    return 1;
}

/* Restore Python's handler; returns 1 if SIGINT arrived while watched. */
static int pyl_sigint_unwatch(void) {
    int seen = pyl_sigint_seen;
    if (pyl_sigint_installed) {
        sigaction(SIGINT, &pyl_old_sigint, NULL);
        pyl_sigint_installed = 0;
    }
    pyl_sigint_seen = 0;
    return seen;
}

/* The reason llama.cpp logs for a failure, kept in C for the calls that take a step or a
 * sequence state (pyl_decode_sample, pyl_state_seq_get/_set), so that no
 * Python capture (pyllamacpp._log.capture) has to wrap them: while armed on this thread, the first
 * ERROR line and the first WARN line are kept, and pyl_reason_text() gives the ERROR one, else the
 * WARN one, as Capture.reason() picks them. */
static _Thread_local int pyl_reason_armed = 0;
static _Thread_local char pyl_reason_err[512], pyl_reason_warn[512];

static void pyl_reason_keep(char *dst, const char *text) {
    if (dst[0]) return;
    size_t n = strcspn(text, "\n");
    if (n >= 512) n = 511;
    memcpy(dst, text, n);
    dst[n] = 0;
}

static void pyl_reason_arm(void) {
    pyl_reason_err[0] = pyl_reason_warn[0] = 0;
    pyl_reason_armed = 1;
}

static const char *pyl_reason_text(void) { return pyl_reason_err[0] ? pyl_reason_err : pyl_reason_warn; }

/* One step of pyllamacpp.generate(), in one call: put `token` at `pos` of `seq_id` into slot 0 of
 * `batch` (logits on), llama_decode it under the abort/SIGINT watch Context.decode uses, then, when
 * `smpl` is not NULL and the decode succeeded, sample the next token from its logits. The C calls
 * are those of examples/simple's loop; done from Python they were a dozen interpreted calls per
 * token, whose cost (in caches that llama_decode had just flushed) showed as 1-2% of tokens/s.
 * The decode's logged failure reason is kept (pyl_reason_text); out->eog saves Python a call. */
typedef struct {
    int32_t rc;      /* llama_decode's return code */
    int32_t sigint;  /* SIGINT arrived while watched */
    int32_t next;    /* the sampled token; -1 when not sampled */
    int32_t eog;     /* next is an end-of-generation token (llama_vocab_is_eog) */
} pyl_step_out;

static void pyl_decode_sample(struct llama_context *ctx, struct llama_batch *batch,
                              struct llama_sampler *smpl, pyl_abort_state *st, int watch,
                              llama_token token, llama_pos pos, llama_seq_id seq_id,
                              const struct llama_vocab *vocab, pyl_step_out *out) {
    pyl_reason_arm();
    batch->n_tokens = 1;
    batch->token[0] = token;
    batch->pos[0] = pos;
    batch->n_seq_id[0] = 1;
    batch->seq_id[0][0] = seq_id;
    batch->logits[0] = 1;
    if (watch) st->watch_sigint = pyl_sigint_watch();
    if (st->taps) pyl_taps_step(st->taps, token, pos, seq_id);
    out->rc = llama_decode(ctx, *batch);
    if (out->rc == 2) st->abort_requested = 0; /* consumed; an abort() that came too late stays for the next */
    out->sigint = 0;
    if (watch) {
        out->sigint = pyl_sigint_unwatch();
        st->watch_sigint = 0;
    }
    pyl_reason_armed = 0;
    if (out->rc == 0 && st->taps && pyl_taps_failed(st->taps)) out->rc = PYL_STEP_TAPS_FAILED;
    out->next = (out->rc == 0 && smpl != NULL) ? llama_sampler_sample(smpl, ctx, -1) : -1;
    out->eog = out->next >= 0 && llama_vocab_is_eog(vocab, out->next);
}

/* The log callback llama.cpp gets. DEBUG lines (about 1,100 when a context is created, one per
 * sequence state load) stay in C unless Python wants them (pyl_log_debug, set from the logger's
 * level by pyllamacpp._log): each line that reaches Python takes the GIL and a trip through the
 * interpreter. A GGML_LOG_LEVEL_CONT line goes where the line it continues went. */
static void _pyllamacpp_log_cb(enum ggml_log_level, const char *, void *); /* cffi defines it below */
static volatile int pyl_log_debug = 0;
static _Thread_local int pyl_log_in_debug = 0;

static void pyl_log_cb(enum ggml_log_level level, const char *text, void *user_data) {
    if (level != GGML_LOG_LEVEL_CONT) pyl_log_in_debug = level == GGML_LOG_LEVEL_DEBUG;
    if (pyl_reason_armed && level == GGML_LOG_LEVEL_ERROR) pyl_reason_keep(pyl_reason_err, text);
    if (pyl_reason_armed && level == GGML_LOG_LEVEL_WARN) pyl_reason_keep(pyl_reason_warn, text);
    if (pyl_log_in_debug && !pyl_log_debug) return;
    _pyllamacpp_log_cb(level, text, user_data);
}

/* ctx.seq_state's default path in one C call: the size llama.cpp asks for, a buffer from malloc,
 * the copy. Python wraps the buffer in ffi.gc(..., pyl_free) and a numpy view over it. One call
 * instead of three from Python, and the dump comes from the allocator the native C loop uses. NULL
 * when malloc fails; out->written < out->size when llama.cpp wrote less. */
typedef struct { size_t size; size_t written; } pyl_state_out;

static uint8_t *pyl_state_seq_get(struct llama_context *ctx, llama_seq_id seq_id, llama_state_seq_flags flags,
                                  pyl_state_out *out) {
    pyl_reason_arm();
    out->size = llama_state_seq_get_size_ext(ctx, seq_id, flags);
    out->written = 0;
    uint8_t *buf = malloc(out->size ? out->size : 1);
    if (buf) out->written = llama_state_seq_get_data_ext(ctx, buf, out->size, seq_id, flags);
    pyl_reason_armed = 0;
    return buf;
}

/* llama_state_seq_set_data_ext with the failure's reason kept (pyl_reason_text). */
static size_t pyl_state_seq_set(struct llama_context *ctx, const uint8_t *src, size_t size, llama_seq_id seq_id,
                                llama_state_seq_flags flags) {
    pyl_reason_arm();
    size_t n = llama_state_seq_set_data_ext(ctx, src, size, seq_id, flags);
    pyl_reason_armed = 0;
    return n;
}

static void pyl_free(void *p) { free(p); }
