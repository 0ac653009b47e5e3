/* coordlfs request lane: the daemon's cache hits answered in C, without the Python loop.
 *
 * Why: with FUSE passthrough a cache hit costs the daemon only OPEN and RELEASE, but each is
 * a wake of the trio loop and a pass through the Python handlers (84 us of daemon CPU per
 * hit against 38 us for libfuse's C passthrough_hp; docs/design/request-path.md). Neither
 * needs a decision once the daemon has made it for an inode: "this inode's file is the cache
 * entry registered as backing id B, of version V". So the daemon writes that down here, a row
 * per inode (lane_offer), and a thread of this library reads /dev/fuse itself (a blocking
 * read, as passthrough_hp does): an OPEN (read-only) of an inode with an active row whose
 * source file is still version V (one openat2 + fstat beneath the source's root, the rules
 * coordlfs.source.walk uses) is answered at once with B; the RELEASE of a handle it made
 * (fh with LANE_FH set) is answered too. Every other request is queued for the daemon's
 * trio loop, which takes it with lane_take (the patched pyfuse3's loop, part (e) of
 * scripts/pyfuse3-passthrough.patch) and answers it as before, woken by an eventfd only
 * when it was waiting.
 *
 * The daemon stays the owner of every decision: a row is only what it decided at an open it
 * answered itself (coordlfs/fs/lane.py); the opens a row holds are counted here and read by
 * the daemon where they matter (one backing per inode, the version its open files read); a
 * RELEASE of a handle whose row is suspended goes to the daemon, which may have to close the
 * backing id at the last of them. Counters (opens and bytes answered here) are read by the
 * daemon into its own (coordlfs.cache.stats folds).
 *
 * Locking: one mutex over the rows and the queue, held for table probes only: the version
 * check's system calls run outside it, so several lane threads check at once.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/openat2.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

/* -- the kernel's ABI (linux/fuse.h of 7.40; the system's header may be older) ------------ */
#define FUSE_OPEN 14
#define FUSE_RELEASE 18
#define FOPEN_NOFLUSH (1u << 5)
#define FOPEN_PASSTHROUGH (1u << 7)

struct in_header {
    uint32_t len, opcode;
    uint64_t unique, nodeid;
    uint32_t uid, gid, pid;
    uint16_t total_extlen, padding;
};
struct out_header {
    uint32_t len;
    int32_t error;
    uint64_t unique;
};
struct open_in {
    uint32_t flags, open_flags;
};
struct open_out {
    uint64_t fh;
    uint32_t open_flags;
    int32_t backing_id;
};
struct release_in {
    uint64_t fh;
    uint32_t flags, release_flags;
    uint64_t lock_owner;
};

/* The handles this lane gives out: the inode's number with the top bit set (the daemon's
 * own are small counters). */
#define LANE_FH (1ULL << 63)
/* A read of /dev/fuse must have room for the largest request: libfuse's own buffer size. */
#define BUFSIZE ((256 + 1) * 4096)
/* An open with any of these the daemon answers (EROFS), as coordlfs.fs.operations does. */
#define WRITE_FLAGS (O_WRONLY | O_RDWR | O_TRUNC | O_APPEND | O_CREAT)

/* What a row answers opens with, and the source file's version it stands for. */
struct version {
    uint64_t dev, ino;
    int64_t size, mtime_ns, ctime_ns;
    int32_t backing, zero; /* no padding: versions are compared with memcmp */
};

struct row {
    struct row *next;
    uint64_t nodeid;
    int active;
    int64_t opens;
    struct version v;
    char path[];
};

struct queued {
    struct queued *next;
    size_t len;
    char mem[];
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct row **buckets;
static size_t nbuckets, nrows;
static struct queued *head, *tail;
static int waiting, ended, enabled = 1, serving;
static int dev_fd = -1, wake_fd = -1, root_fd = -1;
static _Atomic uint64_t answered_opens, answered_bytes, answered_releases;

/* -- rows --------------------------------------------------------------------------------- */

static struct row **slot_of(uint64_t nodeid) {
    struct row **at = &buckets[(nodeid * 0x9E3779B97F4A7C15ULL) >> 32 & (nbuckets - 1)];
    while (*at && (*at)->nodeid != nodeid)
        at = &(*at)->next;
    return at;
}

static struct row *find(uint64_t nodeid) {
    return nbuckets ? *slot_of(nodeid) : NULL;
}

static int grow(void) {
    size_t n = nbuckets ? nbuckets * 2 : 1024;
    struct row **fresh = calloc(n, sizeof *fresh);
    if (!fresh)
        return -ENOMEM;
    struct row **old = buckets;
    size_t was = nbuckets;
    buckets = fresh;
    nbuckets = n;
    for (size_t i = 0; i < was; i++)
        for (struct row *r = old[i], *next; r; r = next) {
            next = r->next;
            struct row **at = slot_of(r->nodeid);
            r->next = *at;
            *at = r;
        }
    free(old);
    return 0;
}

/* The row of `nodeid`: answer its read-only opens with `backing` while its source file at
 * `path` (beneath the root) is the version given. 0, or -EBUSY when opens of another backing
 * are held (the kernel gives an inode one backing at a time), -ENOMEM. */
EXPORT int lane_offer(uint64_t nodeid, int32_t backing, const char *path, uint64_t dev,
                      uint64_t ino, int64_t size, int64_t mtime_ns, int64_t ctime_ns) {
    size_t plen = strlen(path);
    pthread_mutex_lock(&lock);
    int rc = 0;
    if (nrows >= nbuckets && (rc = grow()) < 0)
        goto out;
    struct row **at = slot_of(nodeid), *r = *at;
    if (r && r->opens && r->v.backing != backing) {
        rc = -EBUSY;
        goto out;
    }
    if (!r || strlen(r->path) < plen) {
        struct row *fresh = malloc(sizeof *fresh + plen + 1);
        if (!fresh) {
            rc = -ENOMEM;
            goto out;
        }
        fresh->opens = r ? r->opens : 0;
        fresh->next = r ? r->next : *at;
        if (!r)
            nrows++;
        free(r);
        *at = r = fresh;
    }
    memcpy(r->path, path, plen + 1);
    r->nodeid = nodeid;
    r->v = (struct version){dev, ino, size, mtime_ns, ctime_ns, backing, 0};
    r->active = 1;
out:
    pthread_mutex_unlock(&lock);
    return rc;
}

/* No more opens of `nodeid` answered here (the daemon decides them now); the opens the row
 * holds, which go on being counted. */
EXPORT int64_t lane_suspend(uint64_t nodeid) {
    pthread_mutex_lock(&lock);
    struct row *r = find(nodeid);
    int64_t opens = r ? (r->active = 0, r->opens) : 0;
    pthread_mutex_unlock(&lock);
    return opens;
}

/* The opens of `nodeid` answered here and not released yet. */
EXPORT int64_t lane_held(uint64_t nodeid) {
    pthread_mutex_lock(&lock);
    struct row *r = find(nodeid);
    int64_t opens = r ? r->opens : 0;
    pthread_mutex_unlock(&lock);
    return opens;
}

/* A release of one of the row's handles the daemon was given (the row was suspended): the
 * opens left, -1 if there is no row. */
EXPORT int64_t lane_release(uint64_t nodeid) {
    pthread_mutex_lock(&lock);
    struct row *r = find(nodeid);
    int64_t opens = r ? (r->opens > 0 ? --r->opens : 0) : -1;
    pthread_mutex_unlock(&lock);
    return opens;
}

/* Remove the row of `nodeid`: 0, or the opens it still holds (then it stays, suspended). */
EXPORT int64_t lane_drop(uint64_t nodeid) {
    pthread_mutex_lock(&lock);
    int64_t opens = 0;
    if (nbuckets) {
        struct row **at = slot_of(nodeid), *r = *at;
        if (r && r->opens) {
            r->active = 0;
            opens = r->opens;
        } else if (r) {
            *at = r->next;
            free(r);
            nrows--;
        }
    }
    pthread_mutex_unlock(&lock);
    return opens;
}

/* Whether opens are answered here at all (the daemon turns it off while an aligned group
 * needs to see every open). */
EXPORT void lane_enable(int on) {
    pthread_mutex_lock(&lock);
    enabled = on;
    pthread_mutex_unlock(&lock);
}

/* What the lane answered since it started: opens, their files' bytes, releases. */
EXPORT void lane_counts(uint64_t out[3]) {
    out[0] = atomic_load(&answered_opens);
    out[1] = atomic_load(&answered_bytes);
    out[2] = atomic_load(&answered_releases);
}

/* -- answers ------------------------------------------------------------------------------ */

static void reply(uint64_t unique, const void *arg, size_t len) {
    struct {
        struct out_header h;
        struct open_out o;
    } out = {{(uint32_t)(sizeof out.h + len), 0, unique}, {0, 0, 0}};
    if (len)
        memcpy(&out.o, arg, len);
    /* ENOENT: the request was interrupted meanwhile, as libfuse ignores it too */
    (void)!write(dev_fd, &out, sizeof out.h + len);
}

/* Whether the source file at `path` (beneath the root) is version `v` now. */
static int same_version(const char *path, const struct version *v) {
    struct open_how how = {.flags = O_PATH | O_NOFOLLOW | O_CLOEXEC,
                           .resolve = RESOLVE_NO_XDEV | RESOLVE_NO_SYMLINKS};
    int fd = (int)syscall(SYS_openat2, root_fd, path, &how, sizeof how);
    if (fd < 0)
        return 0;
    struct stat st;
    int ok = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && (uint64_t)st.st_dev == v->dev &&
             (uint64_t)st.st_ino == v->ino && st.st_size == v->size &&
             st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec == v->mtime_ns &&
             st.st_ctim.tv_sec * 1000000000LL + st.st_ctim.tv_nsec == v->ctime_ns;
    close(fd);
    return ok;
}

/* The row of `nodeid` if it answers opens, its version and path copied out (0 if not). */
static int answering(uint64_t nodeid, struct version *v, char *path) {
    struct row *r = enabled ? find(nodeid) : NULL;
    if (!r || !r->active || strlen(r->path) >= PATH_MAX)
        return 0;
    *v = r->v;
    strcpy(path, r->path);
    return 1;
}

static int answer_open(const struct in_header *in, const struct open_in *arg) {
    if (arg->flags & WRITE_FLAGS)
        return 0;
    /* the version checked outside the mutex (system calls: other lane threads answer
     * meanwhile), the open counted only if the row still says the same after it */
    struct version v;
    char path[PATH_MAX];
    pthread_mutex_lock(&lock);
    int ok = answering(in->nodeid, &v, path);
    pthread_mutex_unlock(&lock);
    if (!ok || !same_version(path, &v))
        return 0;
    struct open_out out = {in->nodeid | LANE_FH, FOPEN_PASSTHROUGH | FOPEN_NOFLUSH, v.backing};
    pthread_mutex_lock(&lock);
    struct row *r = enabled ? find(in->nodeid) : NULL;
    ok = r && r->active && !memcmp(&r->v, &v, sizeof v);
    if (ok) {
        r->opens++;
        atomic_fetch_add(&answered_opens, 1);
        atomic_fetch_add(&answered_bytes, (uint64_t)v.size);
    }
    pthread_mutex_unlock(&lock);
    if (ok)
        reply(in->unique, &out, sizeof out);
    return ok;
}

static int answer_release(const struct in_header *in, const struct release_in *arg) {
    if (!(arg->fh & LANE_FH))
        return 0;
    pthread_mutex_lock(&lock);
    struct row *r = find(arg->fh & ~LANE_FH);
    int ok = r && r->active && r->opens > 0;
    if (ok)
        r->opens--;
    pthread_mutex_unlock(&lock);
    if (ok) {
        atomic_fetch_add(&answered_releases, 1);
        reply(in->unique, NULL, 0);
    }
    return ok;
}

static int answered(const char *mem, ssize_t len) {
    const struct in_header *in = (const void *)mem;
    if (len < (ssize_t)sizeof *in)
        return 0;
    const void *arg = mem + sizeof *in;
    if (in->opcode == FUSE_OPEN && len >= (ssize_t)(sizeof *in + sizeof(struct open_in)))
        return answer_open(in, arg);
    if (in->opcode == FUSE_RELEASE && len >= (ssize_t)(sizeof *in + sizeof(struct release_in)))
        return answer_release(in, arg);
    return 0;
}

/* -- the queue to the daemon -------------------------------------------------------------- */

static void wake(void) {
    uint64_t one = 1;
    (void)!write(wake_fd, &one, sizeof one);
}

/* Hand a request to the daemon. Without memory for it the lane waits for some: a request
 * dropped would leave its reader hanging. */
static void enqueue(const char *mem, size_t len) {
    struct queued *q;
    while (!(q = malloc(sizeof *q + len)))
        usleep(1000);
    q->next = NULL;
    q->len = len;
    memcpy(q->mem, mem, len);
    pthread_mutex_lock(&lock);
    if (tail)
        tail->next = q;
    else
        head = q;
    tail = q;
    int was_waiting = waiting;
    waiting = 0;
    pthread_mutex_unlock(&lock);
    if (was_waiting)
        wake();
}

static void *serve(void *unused) {
    (void)unused;
    char *mem = malloc(BUFSIZE);
    for (;;) {
        ssize_t len = mem ? read(dev_fd, mem, BUFSIZE) : -1;
        if (len < 0 && (errno == EINTR || errno == EAGAIN || errno == ENOENT))
            continue; /* ENOENT: a request interrupted before it was read */
        if (len <= 0)
            break; /* ENODEV: unmounted */
        if (!answered(mem, len))
            enqueue(mem, (size_t)len);
    }
    free(mem);
    pthread_mutex_lock(&lock);
    ended = --serving == 0; /* the session's end reaches every reader */
    waiting = 0;
    pthread_mutex_unlock(&lock);
    wake();
    return NULL;
}

/* The daemon's loop: the next request for it copied into `mem` (`cap` bytes), its length;
 * 0 when the session ended; -EAGAIN when there is none (wait for the wake descriptor to be
 * readable, then ask again). */
EXPORT ssize_t lane_take(void *mem, size_t cap) {
    pthread_mutex_lock(&lock);
    struct queued *q = head;
    if (q) {
        head = q->next;
        if (!head)
            tail = NULL;
    }
    int done = ended;
    if (!q && !done) {
        uint64_t count;
        (void)!read(wake_fd, &count, sizeof count); /* non-blocking: a wake already used */
        waiting = 1;
    }
    pthread_mutex_unlock(&lock);
    if (!q)
        return done ? 0 : -EAGAIN;
    ssize_t len = q->len <= cap ? (ssize_t)q->len : -EMSGSIZE;
    if (len > 0)
        memcpy(mem, q->mem, q->len);
    free(q);
    return len;
}

/* The buffer lane_take needs at most. */
EXPORT size_t lane_bufsize(void) {
    return BUFSIZE;
}

/* Start serving the FUSE session `fuse_fd` (the daemon's, after init, before its loop)
 * with source files checked beneath `source_root`, in `threads` threads (the kernel hands
 * each request to one reader; the rows' mutex is all they share): the descriptor to wait
 * on, or -errno. */
EXPORT int lane_start(int fuse_fd, int source_root, int threads) {
    if (dev_fd >= 0)
        return -EALREADY;
    int dev = fcntl(fuse_fd, F_DUPFD_CLOEXEC, 0);
    int root = fcntl(source_root, F_DUPFD_CLOEXEC, 0);
    int efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    /* one open file: its flags are the session's too, whose loop no longer reads it */
    int flags = dev >= 0 ? fcntl(dev, F_GETFL) : -1;
    if (dev < 0 || root < 0 || efd < 0 || flags < 0 ||
        fcntl(dev, F_SETFL, flags & ~O_NONBLOCK) < 0) {
        int e = errno;
        if (dev >= 0)
            close(dev);
        if (root >= 0)
            close(root);
        if (efd >= 0)
            close(efd);
        return -e;
    }
    dev_fd = dev, root_fd = root, wake_fd = efd;
    pthread_t thread;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < threads && !rc; i++)
        if (!(rc = pthread_create(&thread, &attr, serve, NULL)))
            serving++;
    int started = serving;
    pthread_mutex_unlock(&lock);
    pthread_attr_destroy(&attr);
    if (!started) {
        fcntl(dev, F_SETFL, flags);
        close(dev), close(root), close(efd);
        dev_fd = root_fd = wake_fd = -1;
        return -rc;
    }
    return efd;
}
