/* How far apart CPUs 0 and 1 are, seen from memory (a diagnostic, not part of dsml).

     cc -O2 -pthread benchmarks/cpu_pair_probe.c -o /tmp/cpu_pair_probe
     /tmp/cpu_pair_probe [piece KiB, default 512]

   Two threads pinned to CPUs 0 and 1: a ping-pong on one cache line (round trip), and a
   hand-off of freshly written pieces (CPU 0 writes a piece into one of two buffers, CPU 1
   copies it out, as a shared-memory collective stages and reduces), against one CPU
   copying the same piece alone and a 64 MiB memcpy (memory). On the 2-vCPU VMs of this
   project it shows two states that change over minutes with no change inside the VM:
   round trip ~60-200 ns and hand-off 9-20 GB/s, or ~500-900 ns and 2-3 GB/s (the host
   placed the two vCPUs far apart). Shared-memory timings taken in the second state are
   not comparable with the first: run this before and after a benchmark to label it. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define PINGS 100000L

static size_t piece = 512 * 1024;
static long rounds;
static _Alignas(64) atomic_long ping, pong;
static _Alignas(64) atomic_long ready, done;
static char *buf[2], *src, *dst;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void pin(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static void *reader(void *arg) {
    (void)arg;
    pin(1);
    for (long i = 1; i <= PINGS; i++) {
        while (atomic_load_explicit(&ping, memory_order_acquire) != i) {
        }
        atomic_store_explicit(&pong, i, memory_order_release);
    }
    for (long r = 1; r <= rounds; r++) {
        while (atomic_load_explicit(&ready, memory_order_acquire) < r) {
        }
        memcpy(dst, buf[r & 1], piece);
        atomic_store_explicit(&done, r, memory_order_release);
    }
    return NULL;
}

static char *block(size_t n, int value) {
    char *p = aligned_alloc(4096, n);
    if (p == NULL) {
        perror("aligned_alloc");
        exit(1);
    }
    memset(p, value, n);
    return p;
}

int main(int argc, char **argv) {
    if (argc > 1) piece = (size_t)atol(argv[1]) << 10;
    rounds = (long)((200UL << 20) / piece);
    src = block(piece, 1);
    dst = block(piece, 2);
    buf[0] = block(piece, 3);
    buf[1] = block(piece, 4);
    pin(0);
    pthread_t thread;
    pthread_create(&thread, NULL, reader, NULL);

    double t0 = now();
    for (long i = 1; i <= PINGS; i++) {
        atomic_store_explicit(&ping, i, memory_order_release);
        while (atomic_load_explicit(&pong, memory_order_acquire) != i) {
        }
    }
    double round_trip = (now() - t0) / PINGS;

    t0 = now();
    for (long r = 1; r <= rounds; r++) {
        /* buffer r & 1 was last read in round r - 2 */
        while (r > 2 && atomic_load_explicit(&done, memory_order_acquire) < r - 2) {
        }
        memcpy(buf[r & 1], src, piece);
        atomic_store_explicit(&ready, r, memory_order_release);
    }
    while (atomic_load_explicit(&done, memory_order_acquire) < rounds) {
    }
    double handoff = now() - t0;
    pthread_join(thread, NULL);

    t0 = now();
    for (long r = 0; r < rounds; r++) memcpy(buf[r & 1], src, piece);
    double alone = now() - t0;

    size_t big = 64UL << 20;
    char *a = block(big, 5), *b = block(big, 6);
    t0 = now();
    for (int r = 0; r < 4; r++) memcpy(b, a, big);
    double memory = now() - t0;

    double moved = (double)piece * rounds;
    printf("round_trip_ns %.0f handoff_GBps %.1f alone_GBps %.1f memcpy_GBps %.1f\n",
           round_trip * 1e9, moved / handoff / 1e9, moved / alone / 1e9,
           4.0 * big / memory / 1e9);
    return 0;
}
