/* coordlfs peer serving in C: a peer's GET of a whole file this node has cached, answered
 * without the daemon's Python loop.
 *
 * Why: a file from a peer cost the serving daemon about 200 us of CPU in its trio loop
 * (docs/benchmarks/cluster-lane.md): the frame's receive, the request's decoding, the
 * source's lstat, the entry's lookup, the reply's send, each a pass of the loop. Nothing in it
 * needs a decision once the cache holds the file: the daemon already publishes every complete
 * entry, withdrawn the moment its source file may have changed, in the index the preload
 * library reads (coordlfs/cache/published.py, read here through published.h).
 *
 * So a connection of a peer's request lane (coordlfs.fs.lane_peers: one request at a time,
 * whole small files) is handed here by the daemon once it is authenticated and has asked for
 * it (wire Kind.LANE), and a thread of its own serves it: a GET of a whole file that the index
 * holds at the version asked, whose source file still is that version (one openat2 + fstat
 * beneath the source's root, no link followed), is answered with a DATA frame: the header,
 * then the cache entry's file by sendfile, its XXH64 taken from a mapping of the same file
 * (a complete entry's file never changes: one dropped is unlinked, and the open descriptor
 * keeps its bytes). Every other GET (not cached here yet, another version, a range, a path
 * the daemon refuses) is handed to the daemon as a ticket (serving_take), which answers it as
 * it answers its own connections' (coordlfs.peers.server: it may start a fill and wait for
 * it) and gives the reply back (serving_answer); this thread sends it.
 *
 * Everything a peer sends is hostile until proven otherwise, as in the daemon: a frame's
 * header is checked (magic, version, kind GET, a bounded length) before its payload is read,
 * and its checksum before it is used; anything else closes the connection. Connections are
 * capped (serving_connection refuses one past the cap: the daemon serves it in Python), each
 * is closed when no frame starts within the idle timeout, and one whose frame, once started,
 * takes longer than the peer timeout to come in or go out (wire.h's frame_clock: a peer that
 * trickles bytes, or does not read).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <unistd.h>

#define XXH_INLINE_ALL /* the frame checksum (libxxhash-dev's header, no library) */
#include <xxhash.h>

#include "../cache/published.h"
#include "wire.h"

#define EXPORT __attribute__((visibility("default")))

/* The index's name in the cache directory (published.INDEX). */
#define INDEX_NAME "published"

static int root_fd = -1, dir_fd = -1, files_fd = -1, tickets_fd = -1;
static _Atomic int idle_ms, cap;
static long timeout_us;
static _Atomic int64_t open_now;
/* Counters, in serving_counts' order. */
enum { CONNECTIONS, FILES, BYTES, DEFERRED, FAULTS, IDLE_CLOSED, COUNTS };
static _Atomic uint64_t counts[COUNTS];

/* -- the index, mapped; mapped again when the daemon grows it (the old one is retired) ---- */

static pthread_rwlock_t index_lock = PTHREAD_RWLOCK_INITIALIZER;
static const unsigned char *index_map;
static size_t index_length;
static uint64_t index_mask;

/* Map the index anew (under the write lock): 0, or -1 if there is none to map. */
static int remap(void) {
    if (index_map) {
        munmap((void *)index_map, index_length);
        index_map = NULL;
    }
    int fd = openat(dir_fd, INDEX_NAME, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        return -1;
    struct stat st;
    void *map = MAP_FAILED;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size >= HEADER_SIZE)
        map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (map == MAP_FAILED)
        return -1;
    uint64_t slots = index_slots(map, (size_t)st.st_size);
    if (!slots) {
        munmap(map, (size_t)st.st_size);
        return -1;
    }
    index_map = map, index_length = (size_t)st.st_size, index_mask = slots - 1;
    return 0;
}

/* The index's entry for the path whose key is `h` in `f`: 1, else 0. */
static int look_up(const uint64_t h[2], struct found *f) {
    for (int attempt = 0; attempt < 2; attempt++) {
        pthread_rwlock_rdlock(&index_lock);
        int fresh = index_map && !word_at(index_map, RETIRED_AT);
        int hit = fresh && index_probe(index_map, index_mask, h, f);
        pthread_rwlock_unlock(&index_lock);
        if (fresh)
            return hit;
        pthread_rwlock_wrlock(&index_lock);
        if (!index_map || word_at(index_map, RETIRED_AT))
            remap();
        pthread_rwlock_unlock(&index_lock);
    }
    return 0;
}

/* Whether `f` is still published (not withdrawn, its slot not rewritten) in the index it was
 * found in. */
static int still_published(const struct found *f) {
    pthread_rwlock_rdlock(&index_lock);
    int same = index_map && !word_at(index_map, RETIRED_AT) && f->at < index_length &&
               word_at(index_map, f->at) == f->word;
    pthread_rwlock_unlock(&index_lock);
    return same;
}

/* -- a GET answered here ------------------------------------------------------------------ */

/* A path the daemon would serve: relative, no empty, "." or ".." component, no NUL
 * (wire._path_problem); any other goes to the daemon, which refuses it. */
static int plain_path(const char *path, size_t length) {
    if (!length || length > PEER_PATH_MAX || memchr(path, 0, length) || path[0] == '/')
        return 0;
    for (size_t at = 0; at <= length;) {
        const char *end = memchr(path + at, '/', length - at);
        size_t part = (end ? (size_t)(end - path) : length) - at;
        if (!part || (part == 1 && path[at] == '.') ||
            (part == 2 && path[at] == '.' && path[at + 1] == '.'))
            return 0;
        at += part + 1;
    }
    return 1;
}

/* Whether the source file at `path` is the version `f` holds now: a regular file, reached
 * beneath the root through no link and no other filesystem, of its inode, size and times. */
static int source_is(const char *path, const struct found *f) {
    struct open_how how = {.flags = O_PATH | O_NOFOLLOW | O_CLOEXEC,
                           .resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV};
    int fd = (int)syscall(SYS_openat2, root_fd, path, &how, sizeof how);
    if (fd < 0)
        return 0;
    struct stat st;
    int same = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && (uint64_t)st.st_ino == f->ino &&
               (uint64_t)st.st_size == f->size &&
               st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec == f->mtime_ns &&
               st.st_ctim.tv_sec * 1000000000LL + st.st_ctim.tv_nsec == f->ctime_ns;
    close(fd);
    return same;
}

/* The cache entry's file of `f`, open, if it holds `f->size` bytes; else -1. */
static int entry_file(const struct found *f) {
    char name[32];
    snprintf(name, sizeof name, "%llx", (unsigned long long)f->number);
    int fd = openat(files_fd, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    struct stat st;
    if (fd >= 0 && (fstat(fd, &st) || !S_ISREG(st.st_mode) || (uint64_t)st.st_size != f->size)) {
        close(fd);
        fd = -1;
    }
    return fd;
}

/* Checksums of entries' whole files, by entry number (never reused; a complete entry's file
 * never changes): every epoch after the first serves the same files again, and the checksum
 * was a quarter of the C path's CPU per file (its XXH64, and the mapping it is taken from).
 * Direct-mapped, a fixed size: DIGESTS slots of 16 bytes (1 MiB), a slot holding the last
 * number that fell in it; more files than that are partly checked each time. */
#define DIGESTS (1 << 16)
static struct { uint64_t number_1, digest; } digests[DIGESTS];
static pthread_mutex_t digests_mu = PTHREAD_MUTEX_INITIALIZER;

static void remember(uint64_t number, uint64_t digest) {
    size_t slot = number & (DIGESTS - 1);
    pthread_mutex_lock(&digests_mu);
    digests[slot].number_1 = number + 1, digests[slot].digest = digest;
    pthread_mutex_unlock(&digests_mu);
}

/* The checksum of the whole file `fd` (`size` bytes), the entry numbered `number`: 0 and the
 * checksum in `*digest`, -1 if it cannot be read. */
static int digest_of(uint64_t number, int fd, size_t size, uint64_t *digest) {
    size_t slot = number & (DIGESTS - 1);
    pthread_mutex_lock(&digests_mu);
    int known = digests[slot].number_1 == number + 1;
    *digest = digests[slot].digest;
    pthread_mutex_unlock(&digests_mu);
    if (known)
        return 0;
    void *map = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED)
        return -1;
    *digest = XXH64(map, size, 0);
    munmap(map, size);
    remember(number, *digest);
    return 0;
}

/* The DATA frame of the whole file `fd` (`size` bytes), the entry numbered `number`: 1 sent,
 * 0 not (nothing went out: the daemon answers), -1 the connection failed. */
static int send_file(int sock, uint32_t id, uint64_t number, int fd, size_t size,
                     struct frame_clock *clock) {
    uint64_t digest;
    if (digest_of(number, fd, size, &digest))
        return 0;
    unsigned char h[FRAME_HEADER];
    frame_header(h, KIND_DATA, id, size, digest);
    clock->deadline = 0; /* a new frame */
    if (send_all(sock, h, sizeof h, MSG_MORE, clock) < 0)
        return -1;
    for (off_t at = 0; (size_t)at < size;) {
        if (late(clock, 0))
            return -1;
        ssize_t n = sendfile(sock, fd, &at, size - (size_t)at);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1; /* a short file cannot be: its size was checked, and it never changes */
    }
    return 1;
}

/* A GET as the C path reads it: the version asked (size, mtime), and whether it asks for a
 * whole small file at a plain path (`whole`: the only GETs answered here); the path with a
 * NUL after it. */
struct get {
    uint64_t size;
    int64_t mtime_ns;
    int whole;
    uint64_t h[2]; /* the path's key in the index, when whole */
    size_t plen;
    char path[PEER_PATH_MAX + 1];
};

/* The GET whose payload is `get` (`len` bytes, at least GET_HEADER + 1, checksum checked). */
static void read_get(const unsigned char *get, size_t len, struct get *g) {
    uint64_t offset = get_be(get + 16, 8), length = get_be(get + 24, 4);
    g->size = get_be(get, 8);
    g->mtime_ns = (int64_t)get_be(get + 8, 8);
    g->plen = len - GET_HEADER;
    memcpy(g->path, get + GET_HEADER, g->plen);
    g->path[g->plen] = 0;
    g->whole = !offset && length == g->size && g->size && g->size <= PEER_MAX &&
               plain_path(g->path, g->plen);
    if (g->whole)
        path_hash(g->path, g->plen, g->h);
}

/* The entry the index holds for the version `g` asks, in `f`: 1, else 0. */
static int published_as_asked(const struct get *g, struct found *f) {
    return g->whole && look_up(g->h, f) && f->size == g->size &&
           f->mtime_ns == g->mtime_ns;
}

/* `g`, a GET of a whole file the index holds at the version asked, whose source still is
 * that version, answered: 1; 0 if not (the daemon answers it); -1 if the connection failed. */
static int answer_here(int sock, uint32_t id, const struct get *g, struct frame_clock *clock) {
    struct found f;
    if (!published_as_asked(g, &f) || !source_is(g->path, &f))
        return 0;
    int fd = entry_file(&f);
    if (fd < 0)
        return 0;
    int rc = still_published(&f) ? send_file(sock, id, f.number, fd, g->size, clock) : 0;
    close(fd);
    if (rc > 0) {
        atomic_fetch_add(&counts[FILES], 1);
        atomic_fetch_add(&counts[BYTES], g->size);
    }
    return rc;
}

/* -- a GET handed to the daemon ----------------------------------------------------------- */

/* A GET the daemon answers: queued until it takes it (serving_take), then waited for until
 * it answers (serving_answer). */
struct ticket {
    struct ticket *next;
    uint64_t id;
    int taken, done, kind;
    unsigned char *answer;
    size_t answer_len, len;
    const unsigned char *payload;
};

static pthread_mutex_t tickets_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t tickets_cv = PTHREAD_COND_INITIALIZER;
static struct ticket *tickets;
static uint64_t next_ticket;

/* The daemon's answer to the GET `get` (`len` bytes, read as `g`), sent as the reply to `id`:
 * 0, -1 if the connection failed (or there was no memory for the answer: the connection
 * closes, and the peer reads its own storage). The checksum of a whole file it sent is kept
 * for the entry the index now holds at that version (its fill has ended: published), so that
 * the next epoch's first GET of it here takes no mapping of the file. */
static int answer_by_daemon(int sock, uint32_t id, const unsigned char *get, size_t len,
                            const struct get *g, struct frame_clock *clock) {
    struct ticket t = {.payload = get, .len = len};
    pthread_mutex_lock(&tickets_mu);
    t.id = ++next_ticket;
    t.next = tickets;
    tickets = &t;
    pthread_mutex_unlock(&tickets_mu);
    uint64_t one = 1;
    (void)!write(tickets_fd, &one, sizeof one);
    atomic_fetch_add(&counts[DEFERRED], 1);
    pthread_mutex_lock(&tickets_mu);
    while (!t.done)
        pthread_cond_wait(&tickets_cv, &tickets_mu);
    for (struct ticket **at = &tickets; *at; at = &(*at)->next)
        if (*at == &t) {
            *at = t.next;
            break;
        }
    pthread_mutex_unlock(&tickets_mu);
    int rc = -1;
    if (t.answer) {
        uint64_t digest = XXH64(t.answer, t.answer_len, 0);
        struct found f;
        if (t.kind == KIND_DATA && t.answer_len == g->size && published_as_asked(g, &f))
            remember(f.number, digest);
        unsigned char h[FRAME_HEADER];
        frame_header(h, t.kind, id, t.answer_len, digest);
        clock->deadline = 0; /* a new frame */
        rc = send_all(sock, h, sizeof h, MSG_MORE, clock) ||
                 send_all(sock, t.answer, t.answer_len, 0, clock) ? -1 : 0;
        free(t.answer);
    }
    return rc;
}

/* The next GET for the daemon: its payload copied into `mem` (`room` bytes), its length, its
 * ticket in `*ticket`; -EAGAIN if there is none (wait for serving_start's descriptor). */
EXPORT ssize_t serving_take(uint64_t *ticket, void *mem, size_t room) {
    uint64_t count;
    (void)!read(tickets_fd, &count, sizeof count); /* non-blocking */
    pthread_mutex_lock(&tickets_mu);
    struct ticket *t = tickets;
    while (t && t->taken)
        t = t->next;
    ssize_t len = -EAGAIN;
    if (t && t->len <= room) {
        t->taken = 1;
        *ticket = t->id;
        memcpy(mem, t->payload, t->len);
        len = (ssize_t)t->len;
    }
    pthread_mutex_unlock(&tickets_mu);
    return len;
}

/* The daemon's reply to `ticket`: a frame of `kind` with `payload` (`len` bytes, copied);
 * 0, -ENOENT for no such ticket waiting, -ENOMEM (the connection then closes). */
EXPORT int serving_answer(uint64_t ticket, int kind, const void *payload, size_t len) {
    unsigned char *copy = malloc(len ? len : 1);
    pthread_mutex_lock(&tickets_mu);
    struct ticket *t = tickets;
    while (t && !(t->id == ticket && t->taken && !t->done))
        t = t->next;
    int rc = !t ? -ENOENT : !copy ? -ENOMEM : 0;
    if (t) { /* its thread may return the moment the mutex goes: nothing of it read after */
        if (copy)
            memcpy(copy, payload, len);
        t->answer = copy, t->answer_len = len, t->kind = kind, t->done = 1;
        copy = NULL;
        pthread_cond_broadcast(&tickets_cv);
    }
    pthread_mutex_unlock(&tickets_mu);
    free(copy);
    return rc;
}

/* -- a connection ------------------------------------------------------------------------- */

/* A frame's header received on `clock`, when one starts within the idle timeout: 0; 1 the
 * connection is to close without a fault (the peer closed it, or it was idle); -1 a fault. */
static int next_header(int sock, unsigned char h[FRAME_HEADER], struct frame_clock *clock) {
    clock->deadline = 0; /* a new frame */
    struct pollfd p = {sock, POLLIN, 0};
    int n;
    while ((n = poll(&p, 1, atomic_load(&idle_ms))) < 0 && errno == EINTR)
        ;
    if (n == 0) {
        atomic_fetch_add(&counts[IDLE_CLOSED], 1);
        return 1;
    }
    int rc = n < 0 ? FAILED : recv_all(sock, h, FRAME_HEADER, clock);
    return rc == CLOSED_FIRST ? 1 : rc < 0 ? -1 : 0;
}

static void *serve_connection(void *arg) {
    int sock = (int)(intptr_t)arg;
    unsigned char h[FRAME_HEADER], *get = malloc(GET_HEADER + PEER_PATH_MAX);
    struct get g;
    int rc = get ? 0 : -1;
    struct frame_clock clock = frame_clock(sock);
    while (!rc && !(rc = next_header(sock, h, &clock))) {
        uint32_t id = (uint32_t)get_be(h + 6, 4);
        uint64_t len = get_be(h + 10, 4);
        if (memcmp(h, "CLFP", 4) || h[4] != 1 || h[5] != KIND_GET || len <= GET_HEADER ||
            len > GET_HEADER + PEER_PATH_MAX || recv_all(sock, get, len, &clock) ||
            XXH64(get, len, 0) != get_be(h + 14, 8)) {
            rc = -1;
            break;
        }
        read_get(get, len, &g);
        if (!(rc = answer_here(sock, id, &g, &clock)))
            rc = answer_by_daemon(sock, id, get, len, &g, &clock);
        else if (rc > 0)
            rc = 0;
    }
    if (rc < 0)
        atomic_fetch_add(&counts[FAULTS], 1);
    free(get);
    close(sock);
    atomic_fetch_sub(&open_now, 1);
    return NULL;
}

/* Serve the connection `sock` (authenticated, nothing of a next frame read) on a thread of
 * its own, made blocking with the peer timeout as its SO_RCVTIMEO and SO_SNDTIMEO: 0, and the
 * descriptor is this library's; -ENOSPC at the cap, or -errno (the caller keeps it, as it
 * was). */
EXPORT int serving_connection(int sock) {
    if (tickets_fd < 0)
        return -EINVAL;
    if (atomic_fetch_add(&open_now, 1) >= atomic_load(&cap)) {
        atomic_fetch_sub(&open_now, 1);
        return -ENOSPC;
    }
    /* one open file with the daemon's descriptor, which it closes without another use */
    int flags = fcntl(sock, F_GETFL);
    struct timeval tv = {timeout_us / 1000000, timeout_us % 1000000};
    if (flags < 0 || fcntl(sock, F_SETFL, flags & ~O_NONBLOCK) ||
        setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) ||
        setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv)) {
        int e = errno;
        atomic_fetch_sub(&open_now, 1);
        return -e;
    }
    pthread_t thread;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    int rc = pthread_create(&thread, &attr, serve_connection, (void *)(intptr_t)sock);
    pthread_attr_destroy(&attr);
    if (rc) {
        fcntl(sock, F_SETFL, flags);
        atomic_fetch_sub(&open_now, 1);
        return -rc;
    }
    atomic_fetch_add(&counts[CONNECTIONS], 1);
    return 0;
}

/* Serve from the cache directory `cache_dir` (its index) and its `files` directory, checking
 * source files beneath `source_root`; connections at most `connections`, a frame bounded by
 * `timeout_s` (the peer timeout), a connection closed after `idle_s` seconds without one: the
 * descriptor that is readable when GETs wait for the daemon (serving_take), or -errno. */
EXPORT int serving_start(int source_root, int cache_dir, int files_dir, double timeout_s,
                         double idle_s, int connections) {
    if (tickets_fd >= 0)
        return -EALREADY;
    int fds[4] = {fcntl(source_root, F_DUPFD_CLOEXEC, 0), fcntl(cache_dir, F_DUPFD_CLOEXEC, 0),
                  fcntl(files_dir, F_DUPFD_CLOEXEC, 0), eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)};
    for (int i = 0; i < 4; i++)
        if (fds[i] < 0) {
            int e = errno;
            for (int k = 0; k < 4; k++)
                if (fds[k] >= 0)
                    close(fds[k]);
            return -e;
        }
    root_fd = fds[0], dir_fd = fds[1], files_fd = fds[2];
    atomic_store(&idle_ms, idle_s * 1000 > INT32_MAX ? INT32_MAX : (int)(idle_s * 1000));
    atomic_store(&cap, connections);
    double us = timeout_s * 1e6;
    timeout_us = us > 1e12 ? (long)1e12 : us < 1000 ? 1000 : (long)us;
    tickets_fd = fds[3];
    return tickets_fd;
}

/* The counts (serving.py's COUNTS order) into `out`; the connections open now. */
EXPORT int64_t serving_counts(uint64_t out[COUNTS]) {
    for (int i = 0; i < COUNTS; i++)
        out[i] = atomic_load(&counts[i]);
    return atomic_load(&open_now);
}
