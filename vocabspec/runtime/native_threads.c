/* The thread governor of the native engine (included by native.c). */

/* ------------------------------------------------------------------ threads

   Every parallel region runs on the team the governor sets. A region's threads wait at each
   work-sharing loop's barrier for the slowest of them, and a forward has about eight barriers a
   layer. When another process takes a core, the OS deschedules one of the team for a time slice
   and every barrier waits for it: decoding beside one busy process fell a hundredfold. So each
   forward measures the share of the CPU its team got (the threads' CPU time over team x wall
   time, which spinning at a barrier counts and waiting to be scheduled does not); a share well
   below one shrinks the team to the cores it gets, and now and then one forward tries a larger
   team again (less often after each failed try), when a quick barrier test finds the cores free.
   OpenMP's maximum (OMP_NUM_THREADS) bounds it all. A row's bits do not depend on the team: every
   output element is computed whole by one thread, in one order (see the top of this file). */

static double wall_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static double thread_cpu_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static int team_max, team_now, team_fixed; /* team_fixed: set by vs_set_threads, no governing */
static int probe_wait, probe_gap = 16;
static double share_avg = 1.0;

/* Whether a team of n would run unhindered now: sixteen barriers of n threads within a
   millisecond, timed after a first barrier has woken the sleeping ones (a wake-up is slow on some
   VMs and says nothing of contention). A descheduled thread holds them a time slice
   (milliseconds), so a busy machine fails this at the cost of one slice, not of a stalled
   forward's hundreds. */
static int team_runs_freely(int n) {
    double started = 0.0, took = 0.0;
#pragma omp parallel num_threads(n)
    {
#pragma omp barrier
#pragma omp master
        started = wall_now();
        for (int i = 0; i < 16; i++) {
#pragma omp barrier
        }
#pragma omp master
        took = wall_now() - started;
    }
    return took < 1e-3;
}

/* A new team: all threads if they run freely, else one (probes grow it). Counting runnable tasks
   instead would count this process's own spinning threads (torch's too). */
static int starting_team(void) { return team_max > 1 && team_runs_freely(team_max) ? team_max : 1; }

static void team_init(void) {
    if (team_max == 0) team_max = omp_get_max_threads(), team_now = starting_team();
}

/* The team for the next region (not a forward: no probing). */
static int team(void) {
    team_init();
    return team_fixed ? team_fixed : team_now;
}

/* n > 0: every region runs n threads (at most OpenMP's maximum); 0: the governor decides. */
void vs_set_threads(int n) {
    team_init();
    team_fixed = n > 0 ? (n < team_max ? n : team_max) : 0;
    team_now = starting_team(), share_avg = 1.0, probe_gap = 16, probe_wait = probe_gap;
}

int vs_threads(void) { return team(); }

/* Cores the whole machine left idle since the last call (the kernel's idle and iowait time
   over all CPUs' time, /proc/stat's first line, times the CPU count); -1 where unknown (no
   /proc, the first call, or too short a window for its 10 ms ticks). */
static double idle_cores(void) {
    static unsigned long long last_idle, last_total;
    unsigned long long v[8] = {0};
    FILE *f = fopen("/proc/stat", "r");
    if (f == NULL) return -1.0;
    const int got = fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3],
                           &v[4], &v[5], &v[6], &v[7]);
    fclose(f);
    if (got < 5) return -1.0;
    unsigned long long total = 0;
    for (int i = 0; i < 8; i++) total += v[i];
    const unsigned long long idle = v[3] + v[4];
    const int known = last_total != 0 && total - last_total >= 4 && idle >= last_idle;
    const double cores = known ? (double)(idle - last_idle) / (double)(total - last_total) * omp_get_num_procs() : -1.0;
    last_idle = idle, last_total = total;
    return cores;
}

/* The team for the next forward: the governor's, or one more thread as a probe when the
   machine has left a core idle and a quick barrier test finds it free. A probe beside busy
   cores costs a time slice (its barrier test waits for a thread the OS has not scheduled) or
   a stalled forward, so a machine with no idle core is not probed, and each failed test
   doubles the wait for the next. */
static int forward_team(void) {
    team_init();
    if (team_fixed) return team_fixed;
    if (team_now < team_max && --probe_wait <= 0) {
        const double idle = idle_cores();
        probe_wait = probe_gap;
        if (idle >= 0.0 && idle < 0.5) return team_now;      /* every core busy: no probe */
        if (team_runs_freely(team_now + 1)) return team_now + 1;
        probe_gap = probe_gap < 1024 ? 2 * probe_gap : 1024;
        probe_wait = probe_gap;
    }
    return team_now;
}

/* What a forward on `n` threads measured: CPU seconds of its threads over `wall` seconds. */
void vs_threads_observe(int n, double cpu, double wall) {
    team_init();
    if (team_fixed || wall < 2e-4) return; /* too short to tell a stall from a wake-up */
    const double share = cpu / (n * wall);
    if (n > team_now) { /* a probe: keep the larger team if it ran unhindered */
        if (share >= 0.9) team_now = n, share_avg = 1.0, probe_gap = 16;
        else probe_gap = probe_gap < 1024 ? 2 * probe_gap : 1024;
        probe_wait = probe_gap;
        return;
    }
    share_avg = 0.75 * share_avg + 0.25 * share;
    /* a forward that lost half its time is evidence enough; smaller losses must persist */
    const double seen = share < 0.5 ? share : share_avg;
    if (n > 1 && seen < 0.7) {
        const int fit = (int)(seen * n);
        team_now = fit < 1 ? 1 : fit < n ? fit : n - 1;
        share_avg = 1.0, probe_gap = 16, probe_wait = probe_gap;
    }
}

