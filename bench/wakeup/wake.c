/* What one wake-up costs the thread that wakes, as the kernel charges it
 * (/proc/thread-self/schedstat: run time and switches). Issue 16 reads a balancer's cost
 * at a paced load as system calls, TCP work and wake-ups; this measures the last alone.
 *   wake sleep MS N      N sleeps of MS ms in epoll_wait (a timer wakes the thread)
 *   wake pingpong N      N round trips with a thread on the other core through eventfds
 *                        (each side sleeps in epoll_wait until the other writes; the peer
 *                        waits 200 us before it answers, so the caller really sleeps)
 * Prints microseconds of run time per switch of the measured thread (core 0). */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

static int to_peer, to_main, rounds;

static void run_time(double *us, long *switches) {
    FILE *f = fopen("/proc/thread-self/schedstat", "r");
    double ns = 0;
    long waited = 0;
    if (!f || fscanf(f, "%lf %ld %ld", &ns, &waited, switches) != 3) exit(1);
    fclose(f);
    *us = ns / 1000;
}

static void pin(int core) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(core, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static int watching(int fd) {
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN};
    epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
    return ep;
}

static void *peer(void *unused) {
    (void)unused;
    pin(1);
    int ep = watching(to_peer);
    struct epoll_event ev;
    uint64_t v;
    struct timespec pause = {0, 200000};
    for (int i = 0; i < rounds; i++) {
        epoll_wait(ep, &ev, 1, -1);
        if (read(to_peer, &v, 8) != 8) exit(1);
        nanosleep(&pause, 0);
        v = 1;
        if (write(to_main, &v, 8) != 8) exit(1);
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: wake sleep MS N | wake pingpong N\n");
        return 2;
    }
    pin(0);
    double us0, us1;
    long sw0, sw1;
    struct epoll_event ev;
    if (!strcmp(argv[1], "sleep") && argc == 4) {
        int ms = atoi(argv[2]), n = atoi(argv[3]);
        int ep = epoll_create1(0);
        run_time(&us0, &sw0);
        for (int i = 0; i < n; i++) epoll_wait(ep, &ev, 1, ms);
        run_time(&us1, &sw1);
        printf("sleep %d ms: %.1f us per wake-up (%ld)\n", ms, (us1 - us0) / (sw1 - sw0), sw1 - sw0);
        return 0;
    }
    if (strcmp(argv[1], "pingpong") || argc != 3) {
        fprintf(stderr, "usage: wake sleep MS N | wake pingpong N\n");
        return 2;
    }
    rounds = atoi(argv[2]);
    to_peer = eventfd(0, 0);
    to_main = eventfd(0, 0);
    pthread_t t;
    pthread_create(&t, 0, peer, 0);
    int ep = watching(to_main);
    uint64_t v;
    run_time(&us0, &sw0);
    for (int i = 0; i < rounds; i++) {
        v = 1;
        if (write(to_peer, &v, 8) != 8) return 1;
        epoll_wait(ep, &ev, 1, -1);
        if (read(to_main, &v, 8) != 8) return 1;
    }
    run_time(&us1, &sw1);
    printf("pingpong: %.1f us per wake-up (%ld)\n", (us1 - us0) / (sw1 - sw0), sw1 - sw0);
    pthread_join(t, 0);
    return 0;
}
