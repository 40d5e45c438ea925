/* pyllamacpp's own C helpers, compiled into the extension next to the generated binding.
 *
 * Abort without the GIL: llama.cpp calls the abort callback from its compute threads, often (per
 * graph node). A Python callback there would take the GIL each time and slow decoding down, so the
 * default abort callback is this C function reading a flag that Python sets (ctx.abort() from any
 * thread) or that a SIGINT handler sets while a decode runs on the main thread (Ctrl-C). */
#include <signal.h>
#include <string.h>

typedef struct {
    volatile int abort_requested; /* set by Python: ctx.abort() */
    int watch_sigint;             /* this state also aborts on SIGINT while watched */
} pyl_abort_state;

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
