/* coordlfs request lane: the daemon's cache hits and small misses answered in C, without the
 * Python loop.
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
 * (fh with LANE_FH set) is answered too. A small miss alike (a source row, below): the
 * source file itself is the backing, as passthrough_hp answers every open. A small file a
 * peer caches alike (a peer row, below): a fetcher thread asks the peer for it on a connection
 * of the lane's own and lands the bytes in an unnamed file on the cache's tmpfs, the backing.
 * A GETATTR of an inode with a row is answered while its source file is the row's version, and
 * an IOCTL as libfuse answers it for the daemon (it has none). Every other
 * request is queued for the daemon's trio loop, which takes it with lane_take (the patched
 * pyfuse3's loop, part (e) of scripts/pyfuse3-passthrough.patch) and answers it as before,
 * woken by an eventfd only when it was waiting.
 *
 * The daemon stays the owner of every decision: a row is only what it decided at an open it
 * answered itself (coordlfs/fs/lane.py); the opens a row holds are counted here and read by
 * the daemon where they matter (one backing per inode, the version its open files read),
 * and the daemon keeps nothing per row until it must decide an open of the inode itself:
 * then it adopts the opens held (lane_suspend), and the RELEASEs of their handles go to it,
 * which may have to close the backing id at the last of them. Counters (opens and bytes answered here) are read by the
 * daemon into its own (coordlfs.cache.stats folds).
 *
 * Locking: one mutex over the rows and the queue, held for table probes only: the version
 * check's system calls run outside it, so several lane threads check at once.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <malloc.h>
#include <stddef.h>
#include <linux/openat2.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#define XXH_INLINE_ALL /* the peers' frame checksum (libxxhash-dev's header, no library) */
#include <xxhash.h>

#include "../peers/wire.h"

#include "lane.h"

/* The handles this lane gives out: the inode's number with the top bit set (the daemon's
 * own are small counters). */
#define LANE_FH (1ULL << 63)
/* A read of /dev/fuse must have room for the largest request: libfuse's own buffer size. */
#define BUFSIZE ((256 + 1) * 4096)
/* An open with any of these the daemon answers (EROFS), as coordlfs.fs.operations does. */
#define WRITE_FLAGS (O_WRONLY | O_RDWR | O_TRUNC | O_APPEND | O_CREAT)

/* A source file read through a row with `note`, for the daemon to keep. */
struct note {
    struct note *next;
    uint64_t nodeid;
    int fd;
    int copy; /* a file on the cache's filesystem holding its bytes, or -1 */
    int64_t number; /* the entry number `copy` is named as (lane_numbers), or -1 */
    int32_t backing; /* `copy` registered as a backing file (lane_numbers), or 0 */
    struct version v;
    char path[];
};

struct queued {
    struct queued *next;
    size_t len;
    char mem[];
};

pthread_mutex_t rows_lock = PTHREAD_MUTEX_INITIALIZER;
static struct row **buckets;
static size_t nbuckets, nrows;
static struct queued *head, *tail;
static int waiting, ended, serving;
int enabled = 1;
static int dev_fd = -1, wake_fd = -1, root_fd = -1;
static struct note *notes, *notes_tail;
static int notes_fd = -1;
/* Notes whose files the copier thread copies into the cache's directory (copy_fd) before
 * the daemon is handed them (lane_copy_into). */
static struct note *copying, *copying_tail;
static int64_t copies_queued; /* of those, and the one being copied */
#define NOT_COPIED (-2)
static pthread_cond_t copy_wake = PTHREAD_COND_INITIALIZER;
static int copy_fd = -1;
/* Entry numbers the daemon handed the copier (lane_numbers): each copy is named with the
 * next. */
static int64_t number_next, number_end;
/* Files the cache is to keep and has not been handed yet (note rows with opens, notes), and
 * the room they will take, which the room the daemon told (lane_room) does not count yet. */
static int64_t noting, noting_bytes;
/* Source rows whose opens are held here (the daemon has no record of them). */
static int64_t sources_held;
/* Of those, peer rows: their landed files and those files' bytes (memory beside the cache). */
static int64_t landed_held, landed_held_bytes;
static _Atomic uint64_t answered_opens, answered_bytes, answered_releases, source_opens,
    source_bytes, source_opened_bytes, peer_opens, peer_opened_bytes, answered_getattrs,
    answered_ioctls, copies, copies_named;
/* How long the kernel may keep the attributes a GETATTR is answered with (the daemon's
 * freshness timeout, lane_attr_timeout); none answered before it is set. */
_Atomic uint64_t attr_valid_ns;

/* -- peers: the lane's own connection to each, handshaken by the daemon -------------------- */

/* Slots of connections: placement.MAX_PEERS nodes at most. */
#define PEER_SLOTS 256
/* Connections per peer at most: a request waits for its reply on one (the mutex held across
 * the round trip, so the next frame on it is the reply), so several let several fetches of one
 * peer's files overlap, as the daemon's link has several requests in flight. A fault of any
 * kind (a timeout: the daemon set SO_RCVTIMEO and SO_SNDTIMEO; a closed connection, a frame
 * that breaks the protocol) closes one; the daemon dials again before it offers the peer's
 * files to the lane. */
#define PEER_POOL 4
struct peer_link {
    pthread_mutex_t mu;
    int fd;
    uint32_t next_id;
    uint64_t files, bytes, refused, faults, closed;
};
static struct peer_link links[PEER_SLOTS][PEER_POOL];
static int land_fd = -1;
static pthread_once_t links_once = PTHREAD_ONCE_INIT;

static void links_init(void) {
    for (int i = 0; i < PEER_SLOTS; i++)
        for (int k = 0; k < PEER_POOL; k++) {
            pthread_mutex_init(&links[i][k].mu, NULL);
            links[i][k].fd = -1;
        }
}

/* One more connection to the peer in `slot`: `fd` (authenticated, the lane's to close from
 * now on); its place in the slot's pool, or -ENOSPC when the pool has no free place (the
 * caller closes it), -EINVAL for a slot out of range. Never waits for a fetch: the daemon's
 * loop calls it. */
EXPORT int lane_peer_set(int slot, int fd) {
    if (slot < 0 || slot >= PEER_SLOTS)
        return -EINVAL;
    pthread_once(&links_once, links_init);
    for (int k = 0; k < PEER_POOL; k++) {
        struct peer_link *l = &links[slot][k];
        if (pthread_mutex_trylock(&l->mu))
            continue; /* asking on it now */
        int free = l->fd < 0;
        if (free)
            __atomic_store_n(&l->fd, fd, __ATOMIC_RELAXED);
        pthread_mutex_unlock(&l->mu);
        if (free)
            return k;
    }
    return -ENOSPC;
}

/* The connections to the peer in `slot` that are up (a busy one counts); their counts
 * together: files fetched, their bytes, files the peer refused (FAIL), faults (each closed a
 * connection), connections found closed by the peer (idle, or for room) before a request. */
EXPORT int lane_peer_state(int slot, uint64_t out[5]) {
    memset(out, 0, 5 * sizeof *out);
    if (slot < 0 || slot >= PEER_SLOTS)
        return 0;
    pthread_once(&links_once, links_init);
    int up = 0;
    /* read without the connections' mutexes, which fetches hold across their round trips:
     * the daemon's loop calls this */
    for (int k = 0; k < PEER_POOL; k++) {
        struct peer_link *l = &links[slot][k];
        up += __atomic_load_n(&l->fd, __ATOMIC_RELAXED) >= 0;
        uint64_t *counts[5] = {&l->files, &l->bytes, &l->refused, &l->faults, &l->closed};
        for (int i = 0; i < 5; i++)
            out[i] += __atomic_load_n(counts[i], __ATOMIC_RELAXED);
    }
    return up;
}

/* A connection of the slot's pool to ask on, locked: a free one, else (all busy) the first
 * that is up, waited for; NULL if none is up. */
static struct peer_link *take_link(int slot) {
    struct peer_link *pool = links[slot];
    for (int k = 0; k < PEER_POOL; k++) {
        if (pthread_mutex_trylock(&pool[k].mu))
            continue;
        if (pool[k].fd >= 0)
            return &pool[k];
        pthread_mutex_unlock(&pool[k].mu);
    }
    for (int k = 0; k < PEER_POOL; k++) {
        pthread_mutex_lock(&pool[k].mu);
        if (pool[k].fd >= 0)
            return &pool[k];
        pthread_mutex_unlock(&pool[k].mu);
    }
    return NULL;
}

/* Land peers' files in directory `dir_fd` (the cache's tmpfs): a duplicate is kept. */
EXPORT int lane_land_in(int dir_fd) {
    int fd = fcntl(dir_fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0)
        return -errno;
    if (land_fd >= 0)
        close(land_fd);
    land_fd = fd;
    return 0;
}

static int write_all(int fd, const char *mem, size_t len) {
    for (off_t at = 0; len;) {
        ssize_t n = pwrite(fd, mem, len, at);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        mem += n, at += n, len -= (size_t)n;
    }
    return 0;
}

/* A new unnamed file in the landing directory holding `data`, open; -1 if the filesystem
 * cannot take it (full, say). */
static int land(const char *data, size_t len) {
    int fd = openat(land_fd, ".", O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (fd >= 0 && write_all(fd, data, len) < 0) {
        close(fd);
        fd = -1;
    }
    return fd;
}

/* The whole file at `path`, version `v`, from the peer in `slot`, landed: its descriptor,
 * or -1 (the peer refused it, the connection failed, or nothing could land). The reply is
 * checked as coordlfs.peers.wire checks one: magic, version, the request's id, DATA of
 * exactly the file's size, the payload's XXH64. */
static int fetch(int slot, const char *path, const struct version *v) {
    static __thread unsigned char *buffer;
    size_t plen = strlen(path);
    if (slot < 0 || slot >= PEER_SLOTS || v->size <= 0 || v->size > PEER_MAX ||
        plen > PEER_PATH_MAX || land_fd < 0)
        return -1;
    if (!buffer && !(buffer = malloc(FRAME_HEADER + PEER_MAX + PEER_PATH_MAX)))
        return -1;
    pthread_once(&links_once, links_init);
    struct peer_link *l = take_link(slot);
    if (!l)
        return -1;
    int fd = -1, fault = 1, sock = l->fd;
    /* nothing is due on an idle connection: readable now, the peer closed it (its idle
     * timeout, room for another); no request is lost, no fault */
    struct pollfd idle = {sock, POLLIN | POLLRDHUP, 0};
    if (sock >= 0 && poll(&idle, 1, 0) != 0) {
        close(sock);
        __atomic_store_n(&l->fd, sock = -1, __ATOMIC_RELAXED);
        __atomic_fetch_add(&l->closed, 1, __ATOMIC_RELAXED);
    }
    if (sock < 0) {
        pthread_mutex_unlock(&l->mu);
        return -1;
    }
    uint32_t id = ++l->next_id ? l->next_id : ++l->next_id; /* id 0 is the handshake's */
    unsigned char *get = buffer + FRAME_HEADER;
    put_be(get, (uint64_t)v->size, 8);
    put_be(get + 8, (uint64_t)v->mtime_ns, 8);
    put_be(get + 16, 0, 8);
    put_be(get + 24, (uint64_t)v->size, 4);
    memcpy(get + GET_HEADER, path, plen);
    size_t len = GET_HEADER + plen;
    frame_header(buffer, KIND_GET, id, len, XXH64(get, len, 0));
    unsigned char h[FRAME_HEADER];
    struct frame_clock out_clock = frame_clock(sock), in_clock = out_clock;
    int sent = send_all(sock, buffer, FRAME_HEADER + len, 0, &out_clock);
    int rc = sent < 0 ? sent : recv_all(sock, h, sizeof h, &in_clock);
    if (rc == CLOSED_FIRST) { /* closed as it was asked: as one found closed by the poll */
        fault = 0;
        __atomic_fetch_add(&l->closed, 1, __ATOMIC_RELAXED);
        close(sock);
        __atomic_store_n(&l->fd, -1, __ATOMIC_RELAXED);
    }
    if (rc < 0)
        goto out;
    uint32_t kind = h[5], rid = (uint32_t)get_be(h + 6, 4), length = (uint32_t)get_be(h + 10, 4);
    if (memcmp(h, "CLFP", 4) || h[4] != 1 || rid != id ||
        !(kind == KIND_DATA ? length == (uint64_t)v->size : kind == KIND_FAIL && length <= 256) ||
        recv_all(sock, buffer, length, &in_clock) < 0 || XXH64(buffer, length, 0) != get_be(h + 14, 8))
        goto out;
    fault = 0;
    if (kind == KIND_FAIL)
        __atomic_fetch_add(&l->refused, 1, __ATOMIC_RELAXED);
    else if ((fd = land((const char *)buffer, length)) >= 0) {
        __atomic_fetch_add(&l->files, 1, __ATOMIC_RELAXED);
        __atomic_fetch_add(&l->bytes, length, __ATOMIC_RELAXED);
    }
out:
    if (fault) {
        __atomic_fetch_add(&l->faults, 1, __ATOMIC_RELAXED);
        close(sock);
        __atomic_store_n(&l->fd, -1, __ATOMIC_RELAXED);
    }
    pthread_mutex_unlock(&l->mu);
    return fd;
}

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

/* The row of `nodeid`: answer its read-only opens with `backing` (0 with `source`: the
 * source file itself, registered at its first open; `note` NOTE_KEEP: handed to the daemon
 * at a last release the room takes it at (promise); `peer` >= 0: fetched from the peer in
 * that slot at its first open, a peer row) while its source file at `path` (beneath the
 * root) is the version `st` gives (its STAT_FIELDS). 0, or -EBUSY when opens of another
 * backing are held (the kernel gives an inode one backing at a time), -ENOMEM. An entry's
 * row offered again while the daemon holds its opens (adopted) takes them back: their
 * releases are answered here again. */
EXPORT int lane_offer(uint64_t nodeid, int32_t backing, const char *path,
                      const int64_t st[STAT_FIELDS], int source, int note, int peer) {
    pthread_mutex_lock(&rows_lock);
    int rc = offer_locked(nodeid, backing, path, st, source, note, peer);
    pthread_mutex_unlock(&rows_lock);
    return rc;
}

int offer_locked(uint64_t nodeid, int32_t backing, const char *path,
                 const int64_t st[STAT_FIELDS], int source, int note, int peer) {
    uint64_t dev = (uint64_t)st[0], ino = (uint64_t)st[1];
    int64_t size = st[2], mtime_ns = st[3], ctime_ns = st[4];
    size_t plen = strlen(path);
    int rc = 0;
    if (nrows >= nbuckets && (rc = grow()) < 0)
        goto out;
    struct row **at = slot_of(nodeid), *r = *at;
    if (r && r->opens && (r->source || source || r->v.backing != backing)) {
        rc = -EBUSY;
        goto out;
    }
    struct version v = {dev, ino, size, mtime_ns, ctime_ns, 0, 0};
    if (r && r->source && source && r->active && r->peer == peer && !strcmp(r->path, path) &&
        !memcmp(&r->v, &v, offsetof(struct version, backing)))
        goto out; /* offered again (another LOOKUP): it stays as it is (noted, say) */
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
    r->v = (struct version){dev, ino, size, mtime_ns, ctime_ns, source ? 0 : backing, 0};
    memcpy(&r->shown, st + 5, sizeof r->shown);
    r->active = 1;
    r->source = source;
    r->keep = source && peer < 0 && note == NOTE_KEEP;
    r->note = 0;
    r->peer = source ? peer : -1;
    r->noted = 0;
    r->adopted = 0;
    r->handed = 0;
    r->fd = -1;
out:
    return rc;
}

/* A peer row's landed file is held here (1) or no longer (-1). Under the mutex. */
static void held_landed(const struct row *r, int64_t change) {
    if (r->peer >= 0) {
        landed_held += change;
        landed_held_bytes += change * r->v.size;
    }
}

/* Row `r`'s file is to be handed to the cache (`keep`, if the room takes it beside the
 * files already promised: with the headroom to spare, or, `again` (a file promised at its
 * open), at all; or whatever the room if the fills were handed it: its room is promised to
 * it, lane_handed), or no longer is. Under the mutex. */
static void promise(struct row *r, int keep, int again) {
    int64_t pages = pages_of(r->v.size);
    if (r->note) {
        noting--;
        noting_bytes -= pages;
    }
    int room = keep ? room_for(noting_bytes, pages) : 0;
    r->note = room > 0 || (again && room < 0) || (keep && r->handed);
    if (r->note) {
        noting++;
        noting_bytes += pages;
    }
}

/* The row goes from the table. Under the mutex. */
static void remove_row(struct row *r) {
    struct row **at = slot_of(r->nodeid);
    *at = r->next;
    nrows--;
    free(r);
}

/* The row answers no more opens: it goes, or, while it holds some, stays to count their
 * releases. The opens it holds. Under the mutex. */
static int64_t retire_row(struct row *r) {
    int64_t opens = r->opens;
    if (opens)
        r->active = 0;
    else
        remove_row(r);
    return opens;
}

/* What the row answers opens with. */
static int kind_of(const struct row *r) {
    return !r->source ? KIND_ENTRY : r->peer >= 0 ? KIND_PEER : KIND_SOURCE;
}

/* The row's version and shown attributes, as lane_offer took them. */
static void stat_of(const struct row *r, int64_t st[STAT_FIELDS]) {
    int64_t v[5] = {(int64_t)r->v.dev, (int64_t)r->v.ino, r->v.size, r->v.mtime_ns,
                    r->v.ctime_ns};
    memcpy(st, v, sizeof v);
    memcpy(st + 5, &r->shown, sizeof r->shown);
}

/* No more opens of `nodeid` answered here (the daemon decides them now): the opens the row
 * holds become the daemon's (`adopted`), the backing id they read given to it (`*backing`;
 * for a source row also the file's descriptor, `*fd`; else 0 and -1), with what the row
 * answered them with (`*kind`) and the version it was offered at (`st`), and so are their
 * releases; a row with none held goes. The opens held, which go on being counted. With
 * `held_only`, only a row with opens held is touched (the daemon must answer for them: a
 * getattr, a change, its entry dropped). */
EXPORT int64_t lane_suspend(uint64_t nodeid, int32_t *backing, int *fd, int *kind,
                            int64_t st[STAT_FIELDS], int held_only) {
    *backing = 0;
    *fd = -1;
    *kind = KIND_NONE;
    pthread_mutex_lock(&rows_lock);
    struct row *r = find(nodeid);
    int64_t opens = r ? r->opens : 0;
    if (r && (r->adopted || (held_only && !opens)))
        r = NULL;
    if (r && opens) {
        if (r->source) {
            promise(r, 0, 0);
            sources_held--;
            held_landed(r, -1);
        }
        r->active = 0;
        r->adopted = 1;
        *kind = kind_of(r);
        *backing = r->v.backing;
        *fd = r->fd;
        r->fd = -1;
        stat_of(r, st);
    } else if (r)
        remove_row(r);
    pthread_mutex_unlock(&rows_lock);
    return opens;
}

/* What the opens of `nodeid` answered here and still held here read: KIND_NONE if there are
 * none; for an entry's or a peer's file the version they read (`st`, as offered), fixed; a
 * source file is read as it is now (lane_source_fd). */
EXPORT int lane_held_stat(uint64_t nodeid, int64_t st[STAT_FIELDS]) {
    pthread_mutex_lock(&rows_lock);
    struct row *r = find(nodeid);
    int kind = r && r->opens && !r->adopted ? kind_of(r) : KIND_NONE;
    if (kind != KIND_NONE)
        stat_of(r, st);
    pthread_mutex_unlock(&rows_lock);
    return kind;
}

/* Entry rows whose opens are held here (the daemon counts them among the inodes open by
 * passthrough), and the bytes a row takes with its share of the table's (the lane's share
 * of what a cached file costs the daemon; with no row, one with a 64-byte path). */
EXPORT void lane_census(int64_t out[2]) {
    int64_t held = 0, bytes = 0;
    pthread_mutex_lock(&rows_lock);
    for (size_t i = 0; i < nbuckets; i++)
        for (const struct row *r = buckets[i]; r; r = r->next) {
            held += !r->source && r->opens && !r->adopted;
            bytes += (int64_t)malloc_usable_size((void *)r) + MALLOC_HEADER;
        }
    bytes += (int64_t)(nbuckets * sizeof *buckets);
    size_t rows = nrows;
    pthread_mutex_unlock(&rows_lock);
    out[0] = held;
    out[1] = rows ? bytes / (int64_t)rows
                  : (int64_t)(sizeof(struct row) + 64 + MALLOC_HEADER + sizeof *buckets);
}

/* A new descriptor of the source file a source row's held opens read (the caller closes
 * it), -1 if none is held (or they read a peer's file landed here, whose attributes are not
 * the source's): what fstat of them shows, the daemon answers with its fstat. */
EXPORT int lane_source_fd(uint64_t nodeid) {
    pthread_mutex_lock(&rows_lock);
    struct row *r = find(nodeid);
    int fd = r && r->source && r->peer < 0 && r->fd >= 0 ? fcntl(r->fd, F_DUPFD_CLOEXEC, 0) : -1;
    pthread_mutex_unlock(&rows_lock);
    return fd;
}

/* The opens of `nodeid` answered here and not released yet. */
EXPORT int64_t lane_held(uint64_t nodeid) {
    pthread_mutex_lock(&rows_lock);
    struct row *r = find(nodeid);
    int64_t opens = r ? r->opens : 0;
    pthread_mutex_unlock(&rows_lock);
    return opens;
}

/* A release of one of the row's handles the daemon was given (the row was suspended): the
 * opens left, -1 if there is no row. */
EXPORT int64_t lane_release(uint64_t nodeid) {
    pthread_mutex_lock(&rows_lock);
    struct row *r = find(nodeid);
    int64_t opens = r ? (r->opens > 0 ? --r->opens : 0) : -1;
    pthread_mutex_unlock(&rows_lock);
    return opens;
}

/* Remove the row of `nodeid`: 0, or the opens it still holds (then it stays, suspended; a
 * source row the daemon did not adopt goes at the last of their releases, here). */
EXPORT int64_t lane_drop(uint64_t nodeid) {
    pthread_mutex_lock(&rows_lock);
    int64_t opens = drop_locked(nodeid);
    drop_directory_locked(nodeid);
    pthread_mutex_unlock(&rows_lock);
    return opens;
}

int64_t drop_locked(uint64_t nodeid) {
    struct row *r = find(nodeid);
    return r ? retire_row(r) : 0;
}

/* The cache is about to fill `nodeid`'s file: 1 if a source row's opens are reading it to
 * hand it to the cache (then it must not), else 0, and a source row answers no more opens
 * (it goes now, or at the last release of those it answered). */
EXPORT int64_t lane_claim(uint64_t nodeid) {
    pthread_mutex_lock(&rows_lock);
    struct row *r = find(nodeid);
    /* read for the cache now, or read and its note not taken yet */
    int64_t busy = r && r->source && !r->adopted && r->active &&
                   ((r->opens && r->note) || r->noted);
    if (r && r->source && !r->adopted && !busy)
        retire_row(r);
    pthread_mutex_unlock(&rows_lock);
    return busy;
}

/* Whether opens are answered here at all (the daemon turns it off while an aligned group
 * needs to see every open). */
EXPORT void lane_enable(int on) {
    pthread_mutex_lock(&rows_lock);
    enabled = on;
    pthread_mutex_unlock(&rows_lock);
}

/* Answer GETATTR of inodes with rows with attributes the kernel may keep `seconds` (the
 * daemon's replies' timeout: it changes when the source can no longer be watched). */
EXPORT void lane_attr_timeout(double seconds) {
    atomic_store(&attr_valid_ns, (uint64_t)(seconds * 1e9));
}

/* What the lane answered since it started: opens of cache entries, their files' bytes,
 * releases, opens of source files, the bytes read from storage for them (once per file
 * read), their files' bytes (per open), opens of peers' files, their files' bytes (per open;
 * what was fetched: lane_peer_state), GETATTRs, IOCTLs, LOOKUPs, FORGETs
 * (lookup.c), notes' files copied for the cache, and of those, named as their entries. */
EXPORT void lane_counts(uint64_t out[14]) {
    out[0] = atomic_load(&answered_opens);
    out[1] = atomic_load(&answered_bytes);
    out[2] = atomic_load(&answered_releases);
    out[3] = atomic_load(&source_opens);
    out[4] = atomic_load(&source_bytes);
    out[5] = atomic_load(&source_opened_bytes);
    out[6] = atomic_load(&peer_opens);
    out[7] = atomic_load(&peer_opened_bytes);
    out[8] = atomic_load(&answered_getattrs);
    out[9] = atomic_load(&answered_ioctls);
    lookup_counts(out + 10);
    out[12] = atomic_load(&copies);
    out[13] = atomic_load(&copies_named);
}

/* The next source file read through a row with `note`: its path's length (copied into
 * `path`, `cap` bytes), its inode, open descriptor and copy (now the caller's), the entry
 * number the copy is named as and its backing id (`named`: -1 and 0 if none; the caller's
 * too), and version (dev, ino, size, mtime_ns, ctime_ns); -1 if there is none. The
 * descriptor given by lane_notes_fd is readable while there may be some. */
EXPORT ssize_t lane_note(uint64_t *nodeid, int *fd, int *copy, int64_t named[2],
                         int64_t version[5], char *path, size_t cap) {
    pthread_mutex_lock(&rows_lock);
    struct note *n = notes;
    if (n && strlen(n->path) < cap) {
        notes = n->next;
        if (!notes)
            notes_tail = NULL;
        noting--;
        noting_bytes -= pages_of(n->v.size);
        struct row *r = find(n->nodeid);
        if (r && r->noted)
            r->noted = 0; /* the daemon reserves its entry now (lane_claim lets it) */
    } else if (n)
        n = NULL; /* a row's path is shorter than any buffer the daemon passes */
    pthread_mutex_unlock(&rows_lock);
    if (!n)
        return -1;
    *nodeid = n->nodeid;
    *fd = n->fd;
    *copy = n->copy;
    named[0] = n->number;
    named[1] = n->backing;
    int64_t v[5] = {(int64_t)n->v.dev, (int64_t)n->v.ino, n->v.size, n->v.mtime_ns,
                    n->v.ctime_ns};
    memcpy(version, v, sizeof v);
    size_t len = strlen(n->path);
    memcpy(path, n->path, len + 1);
    free(n);
    return (ssize_t)len;
}

EXPORT int lane_notes_fd(void) {
    return notes_fd;
}

/* What the lane holds now: source files read through rows with `note` and not handed to
 * the daemon yet, or still open (files the cache is about to be given, as fills in flight);
 * the rows kept (their memory is the lane's share of the daemon's per-file cost); the
 * inodes whose opens it holds by a source row (the daemon asks for them only then); of
 * those, peer rows' landed files, and their bytes; notes the copier has not handed over. */
EXPORT void lane_gauges(int64_t out[6]) {
    pthread_mutex_lock(&rows_lock);
    out[0] = noting;
    out[1] = (int64_t)nrows;
    out[2] = sources_held;
    out[3] = landed_held;
    out[4] = landed_held_bytes;
    out[5] = copies_queued;
    pthread_mutex_unlock(&rows_lock);
}

/* -- answers ------------------------------------------------------------------------------ */

void reply(uint64_t unique, int error, const void *arg, size_t len) {
    struct out_header h = {(uint32_t)(sizeof h + len), error, unique};
    struct iovec iov[2] = {{&h, sizeof h}, {(void *)arg, len}};
    /* ENOENT: the request was interrupted meanwhile, as libfuse ignores it too */
    (void)!writev(dev_fd, iov, len ? 2 : 1);
}

int open_beneath(const char *path, int flags) {
    struct open_how how = {.flags = (uint64_t)(flags | O_NOFOLLOW | O_CLOEXEC),
                           .resolve = RESOLVE_NO_XDEV | RESOLVE_NO_SYMLINKS};
    return (int)syscall(SYS_openat2, root_fd, path, &how, sizeof how);
}

/* Whether `st` is of a regular file of version `v`. */
static int shows_version(const struct stat *st, const struct version *v) {
    return S_ISREG(st->st_mode) && (uint64_t)st->st_dev == v->dev &&
           (uint64_t)st->st_ino == v->ino && st->st_size == v->size &&
           st->st_mtim.tv_sec * 1000000000LL + st->st_mtim.tv_nsec == v->mtime_ns &&
           st->st_ctim.tv_sec * 1000000000LL + st->st_ctim.tv_nsec == v->ctime_ns;
}

/* The source file at `path` (beneath the root) opened with `flags` if it is version `v`
 * now (its attributes in `st`), else -1. */
static int open_version(const char *path, const struct version *v, int flags,
                        struct stat *st) {
    int fd = open_beneath(path, flags);
    if (fd < 0)
        return -1;
    struct stat mine;
    if (!st)
        st = &mine;
    if (fstat(fd, st) != 0 || !shows_version(st, v)) {
        close(fd);
        return -1;
    }
    return fd;
}

/* The row of `nodeid` if it answers opens, its version and path copied out (NULL if not). */
static struct row *answering(uint64_t nodeid, struct version *v, char *path) {
    struct row *r = enabled ? find(nodeid) : NULL;
    if (!r || !r->active || strlen(r->path) >= PATH_MAX)
        return NULL;
    *v = r->v;
    strcpy(path, r->path);
    return r;
}

/* Whether row `r` still stands for `v` (a source row's backing comes and goes with its
 * opens: not compared). */
static int same_row(const struct row *r, const struct version *v) {
    return !memcmp(&r->v, v, r->source ? offsetof(struct version, backing) : sizeof *v);
}

/* A source row's first open: the file opened as `fd` registered as its backing (the row
 * keeps `fd`), `handed` saying whether the fills were handed it (handed_locked); 0 if the
 * kernel refused it (the row then answers no more opens). Under the mutex, so that an
 * inode's opens share one backing. */
static int register_source(struct row *r, int fd, int handed) {
    struct backing_map map = {fd, 0, 0};
    int id = ioctl(dev_fd, BACKING_OPEN, &map);
    if (id <= 0) {
        r->active = 0;
        return 0;
    }
    r->v.backing = id;
    r->fd = fd;
    r->handed = handed;
    promise(r, r->keep, 0);
    sources_held++;
    held_landed(r, 1);
    return 1;
}

/* The file a source row's first open registers: the source file (`fd`, opened by the
 * version check), or for a peer row the peer's file fetched and landed now (the check's `fd`
 * closed); -1 if there is none. */
static int first_file(int peer, const char *path, const struct version *v, int fd) {
    if (peer < 0)
        return fd;
    close(fd);
    return fetch(peer, path, v);
}

/* A peer row whose file could not be had (refused, the connection failed, nothing landed)
 * answers no more opens: the daemon decides them (it asks the peer again, or reads the
 * source). */
static void give_up(uint64_t nodeid, const struct version *v) {
    pthread_mutex_lock(&rows_lock);
    struct row *r = find(nodeid);
    if (r && r->peer >= 0 && !r->opens && same_row(r, v))
        retire_row(r);
    pthread_mutex_unlock(&rows_lock);
}

static int defer_fetch(const char *mem, size_t len);

/* An OPEN (`mem`, `len` bytes): answered (1), else 0 (the daemon's). A peer row's first open
 * is answered by a fetcher thread (`fetching`): the thread that read it goes on reading
 * /dev/fuse meanwhile, so no request waits behind a peer's round trip. */
static int answer_open(const char *mem, size_t len, int fetching) {
    const struct in_header *in = (const void *)mem;
    const struct open_in *arg = (const void *)(mem + sizeof *in);
    if (arg->flags & WRITE_FLAGS)
        return 0;
    /* the version checked outside the mutex (system calls: other lane threads answer
     * meanwhile), the open counted only if the row still says the same after it */
    struct version v;
    char path[PATH_MAX];
    pthread_mutex_lock(&rows_lock);
    struct row *r = answering(in->nodeid, &v, path);
    int source = r ? r->source : 0, peer = r ? r->peer : -1, first = r && !r->opens;
    pthread_mutex_unlock(&rows_lock);
    if (!r)
        return 0;
    if (peer >= 0 && first && !fetching)
        return defer_fetch(mem, len);
    int fd = open_version(path, &v, source && peer < 0 ? O_RDONLY | O_NONBLOCK | O_NOCTTY
                                                       : O_PATH, NULL);
    if (fd < 0)
        return 0;
    if (!source) {
        close(fd);
        fd = -1;
    } else if (first && (fd = first_file(peer, path, &v, fd)) < 0) {
        give_up(in->nodeid, &v);
        return 0;
    }
    pthread_mutex_lock(&rows_lock);
    r = enabled ? find(in->nodeid) : NULL;
    int ok = r && r->active && r->source == source && r->peer == peer && same_row(r, &v);
    int fetched = 0; /* this open registered the file: its bytes were read for it */
    if (ok && source && !r->opens) {
        /* a peer row's opens all went since it looked: it has no file; a file the room
         * takes only within the headroom: the daemon's open reserves it, unless the fills
         * were handed it (its room is promised to it) */
        int handed = r->keep && handed_locked(r->path);
        ok = (first || peer < 0) &&
             !(r->keep && !handed && room_for(noting_bytes, pages_of(v.size)) < 0) &&
             register_source(r, fd, handed);
        if (ok) {
            fetched = 1;
            fd = -1;
        }
    }
    struct open_out out = {in->nodeid | LANE_FH, FOPEN_PASSTHROUGH | FOPEN_NOFLUSH,
                           ok ? r->v.backing : 0};
    if (ok && peer >= 0) {
        r->opens++;
        atomic_fetch_add(&peer_opens, 1);
        atomic_fetch_add(&peer_opened_bytes, (uint64_t)v.size);
    } else if (ok) {
        /* a source file's bytes are read from storage once for the opens that share its
         * backing (the first one's), an entry's counted per open as the daemon counts hits */
        if (!source || (fetched && !r->noted))
            atomic_fetch_add(source ? &source_bytes : &answered_bytes, (uint64_t)v.size);
        r->opens++;
        atomic_fetch_add(source ? &source_opens : &answered_opens, 1);
        if (source)
            atomic_fetch_add(&source_opened_bytes, (uint64_t)v.size);
    }
    pthread_mutex_unlock(&rows_lock);
    if (fd >= 0)
        close(fd);
    if (ok)
        reply(in->unique, 0, &out, sizeof out);
    return ok;
}

static void push_note(struct note *n) {
    n->next = NULL;
    pthread_mutex_lock(&rows_lock);
    if (copy_fd >= 0 && n->copy == NOT_COPIED) { /* the copier's first */
        if (copying_tail)
            copying_tail->next = n;
        else
            copying = n;
        copying_tail = n;
        copies_queued++;
        pthread_cond_signal(&copy_wake);
        pthread_mutex_unlock(&rows_lock);
        return;
    }
    if (n->copy == NOT_COPIED)
        n->copy = -1;
    else
        copies_queued--; /* copied (or not): the daemon's */
    int was_empty = !notes;
    if (notes_tail)
        notes_tail->next = n;
    else
        notes = n;
    notes_tail = n;
    pthread_mutex_unlock(&rows_lock);
    uint64_t one = 1;
    if (was_empty)
        (void)!write(notes_fd, &one, sizeof one);
}

/* The last release of a source row's opens: its id closed; with `note`, the file (still
 * open) handed to the daemon (the note made here) once, the row answering on until the
 * daemon reserves the entry (lane_claim); a row that no longer answers goes. Under the
 * mutex. */
static struct note *source_done(struct row *r, int *id, int *fd) {
    sources_held--;
    held_landed(r, -1);
    *id = r->v.backing;
    *fd = r->fd;
    r->v.backing = 0;
    r->fd = -1;
    if (!r->active) {
        promise(r, 0, 0); /* not handed over: the daemon no longer wants it */
        remove_row(r);
        return NULL;
    }
    if (r->note)
        /* again: the room may have gone to other files since its first open; within the
         * headroom it still takes it (the daemon's reservation is exact), and a file
         * promised at an open the headroom let in under a room the daemon had not yet
         * told smaller was dropped here, read and not cached with room to spare */
        promise(r, 1, 1);
    if (!r->note)
        return NULL;
    struct note *n = malloc(sizeof *n + strlen(r->path) + 1);
    if (!n) {
        promise(r, 0, 0);
        return NULL;
    }
    r->note = 0; /* promised until the daemon takes the note */
    r->noted = 1;
    n->nodeid = r->nodeid;
    n->fd = *fd;
    n->copy = NOT_COPIED;
    n->number = -1;
    n->backing = 0;
    n->v = r->v;
    strcpy(n->path, r->path);
    *fd = -1;
    return n;
}

static int answer_release(const struct in_header *in, const struct release_in *arg) {
    if (!(arg->fh & LANE_FH))
        return 0;
    int id = 0, fd = -1;
    struct note *n = NULL;
    pthread_mutex_lock(&rows_lock);
    struct row *r = find(arg->fh & ~LANE_FH);
    /* a row the daemon adopted: the daemon's release */
    int ok = r && r->opens > 0 && !r->adopted;
    if (ok && !--r->opens && r->source)
        n = source_done(r, &id, &fd);
    else if (ok && !r->opens && !r->active)
        remove_row(r); /* an entry's row retired while its opens were held */
    pthread_mutex_unlock(&rows_lock);
    if (!ok)
        return 0;
    if (id > 0) {
        uint32_t closing = (uint32_t)id;
        (void)!ioctl(dev_fd, BACKING_CLOSE, &closing);
    }
    if (fd >= 0)
        close(fd);
    if (n)
        push_note(n);
    atomic_fetch_add(&answered_releases, 1);
    reply(in->unique, 0, NULL, 0);
    return ok;
}

void attr_of(struct attr *out, const struct stat *st, uint64_t nodeid) {
    *out = (struct attr){nodeid, (uint64_t)st->st_size, (uint64_t)st->st_blocks,
        (uint64_t)st->st_atim.tv_sec, (uint64_t)st->st_mtim.tv_sec, (uint64_t)st->st_ctim.tv_sec,
        (uint32_t)st->st_atim.tv_nsec, (uint32_t)st->st_mtim.tv_nsec,
        (uint32_t)st->st_ctim.tv_nsec, st->st_mode, (uint32_t)st->st_nlink, st->st_uid,
        st->st_gid, (uint32_t)st->st_rdev, (uint32_t)st->st_blksize, 0};
}

/* A GETATTR of an inode with a row, while the source file is the row's version: its
 * attributes now, as the daemon answers (its getattr shows the version the inode's open
 * files read, which is the row's, and that is the source file's now). */
static int answer_getattr(const struct in_header *in) {
    uint64_t valid = atomic_load(&attr_valid_ns);
    struct version v;
    char path[PATH_MAX];
    pthread_mutex_lock(&rows_lock);
    struct row *r = valid ? answering(in->nodeid, &v, path) : NULL;
    pthread_mutex_unlock(&rows_lock);
    struct stat st;
    int fd = r ? open_version(path, &v, O_PATH, &st) : -1;
    if (fd < 0)
        return 0;
    close(fd);
    struct attr_out out = {valid / 1000000000u, (uint32_t)(valid % 1000000000u), 0, {0}};
    attr_of(&out.attr, &st, in->nodeid);
    atomic_fetch_add(&answered_getattrs, 1);
    reply(in->unique, 0, &out, sizeof out);
    return 1;
}

/* An IOCTL (isatty's TCGETS, at every open by Python's io.open): the daemon has no ioctl,
 * and libfuse answers ENOSYS (ENOTTY for a directory's, the capability not asked for). */
static int answer_ioctl(const struct in_header *in, const struct ioctl_in *arg) {
    atomic_fetch_add(&answered_ioctls, 1);
    reply(in->unique, arg->flags & FUSE_IOCTL_DIR ? -ENOTTY : -ENOSYS, NULL, 0);
    return 1;
}

static int answered(char *mem, ssize_t len) {
    const struct in_header *in = (const void *)mem;
    if (len < (ssize_t)sizeof *in)
        return 0;
    if (lookup_answered(mem, (size_t)len))
        return 1;
    const void *arg = mem + sizeof *in;
    if (in->opcode == FUSE_GETATTR)
        return answer_getattr(in);
    if (in->opcode == FUSE_IOCTL && len >= (ssize_t)(sizeof *in + sizeof(struct ioctl_in)))
        return answer_ioctl(in, arg);
    if (in->opcode == FUSE_OPEN && len >= (ssize_t)(sizeof *in + sizeof(struct open_in)))
        return answer_open(mem, (size_t)len, 0);
    if (in->opcode == FUSE_RELEASE && len >= (ssize_t)(sizeof *in + sizeof(struct release_in)))
        return answer_release(in, arg);
    return 0;
}

/* -- the queue to the daemon -------------------------------------------------------------- */

static void wake(void) {
    uint64_t one = 1;
    (void)!write(wake_fd, &one, sizeof one);
}

/* A copy of the request `mem` (`len` bytes) to queue, NULL without memory. */
static struct queued *copied(const char *mem, size_t len) {
    struct queued *q = malloc(sizeof *q + len);
    if (q) {
        q->next = NULL;
        q->len = len;
        memcpy(q->mem, mem, len);
    }
    return q;
}

/* `q` at the end of the queue from `*first` to `*last` (under its mutex). */
static void append(struct queued **first, struct queued **last, struct queued *q) {
    if (*last)
        (*last)->next = q;
    else
        *first = q;
    *last = q;
}

/* The first of the queue from `*first` to `*last`, taken off it (under its mutex); NULL if
 * it is empty. */
static struct queued *pop(struct queued **first, struct queued **last) {
    struct queued *q = *first;
    if (q && !(*first = q->next))
        *last = NULL;
    return q;
}

/* Start `threads` detached threads running `run`: how many started; the error of the first
 * that did not in `*rc`. */
static int spawn(void *(*run)(void *), int threads, int *rc) {
    pthread_t thread;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int started = 0;
    *rc = 0;
    while (started < threads && !(*rc = pthread_create(&thread, &attr, run, NULL)))
        started++;
    pthread_attr_destroy(&attr);
    return started;
}

/* Hand a request to the daemon. Without memory for it the lane waits for some: a request
 * dropped would leave its reader hanging. */
static void enqueue(const char *mem, size_t len) {
    struct queued *q;
    while (!(q = copied(mem, len)))
        usleep(1000);
    pthread_mutex_lock(&rows_lock);
    append(&head, &tail, q);
    int was_waiting = waiting;
    waiting = 0;
    pthread_mutex_unlock(&rows_lock);
    if (was_waiting)
        wake();
}

/* -- fetchers: peer rows' first opens, off the threads that read /dev/fuse ---------------- */

/* Threads that fetch at once: the peers' pools' connections in all (PEER_POOL each) are
 * what bounds the fetches in flight; these are started at the first peer row's open. */
#define FETCHERS 8
static pthread_mutex_t fetch_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t fetch_ready = PTHREAD_COND_INITIALIZER;
static struct queued *fetch_head, *fetch_tail;
static int fetchers;

static void *fetcher(void *unused) {
    (void)unused;
    for (;;) {
        pthread_mutex_lock(&fetch_lock);
        while (!fetch_head)
            pthread_cond_wait(&fetch_ready, &fetch_lock);
        struct queued *q = pop(&fetch_head, &fetch_tail);
        pthread_mutex_unlock(&fetch_lock);
        if (!answer_open(q->mem, q->len, 1))
            enqueue(q->mem, q->len);
        free(q);
    }
    return NULL;
}

/* Hand an OPEN to the fetchers: 1, or 0 (no memory, no thread: the daemon answers it). */
static int defer_fetch(const char *mem, size_t len) {
    struct queued *q = copied(mem, len);
    if (!q)
        return 0;
    pthread_mutex_lock(&fetch_lock);
    int rc;
    if (fetchers < FETCHERS)
        fetchers += spawn(fetcher, FETCHERS - fetchers, &rc);
    int ok = fetchers > 0;
    if (ok) {
        append(&fetch_head, &fetch_tail, q);
        pthread_cond_signal(&fetch_ready);
    }
    pthread_mutex_unlock(&fetch_lock);
    if (!ok)
        free(q);
    return ok;
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
        if (!answered(mem, len)) /* a BATCH_FORGET may be left shorter: its header says */
            enqueue(mem, len < (ssize_t)sizeof(struct in_header)
                             ? (size_t)len
                             : ((const struct in_header *)mem)->len);
    }
    free(mem);
    pthread_mutex_lock(&rows_lock);
    ended = --serving == 0; /* the session's end reaches every reader */
    waiting = 0;
    pthread_mutex_unlock(&rows_lock);
    wake();
    return NULL;
}

/* The daemon's loop: the next request for it copied into `mem` (`cap` bytes), its length;
 * 0 when the session ended; -EAGAIN when there is none (wait for the wake descriptor to be
 * readable, then ask again). */
EXPORT ssize_t lane_take(void *mem, size_t cap) {
    pthread_mutex_lock(&rows_lock);
    struct queued *q = pop(&head, &tail);
    int done = ended;
    if (!q && !done) {
        uint64_t count;
        (void)!read(wake_fd, &count, sizeof count); /* non-blocking: a wake already used */
        waiting = 1;
    }
    pthread_mutex_unlock(&rows_lock);
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

/* A new file for a copy in the cache's entries' directory: named as entry `number`'s file
 * (`name`; a leftover of the name, a crash's before its journal line, removed first), or
 * unnamed (O_TMPFILE) with no number, for the daemon to name; -1 if it cannot be made. */
static int copy_file(int64_t number, char name[24]) {
    if (number < 0)
        return openat(copy_fd, ".", O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    snprintf(name, 24, "%" PRIx64, (uint64_t)number);
    int flags = O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC;
    int out = openat(copy_fd, name, flags, 0600);
    if (out < 0 && errno == EEXIST && unlinkat(copy_fd, name, 0) == 0)
        out = openat(copy_fd, name, flags, 0600);
    return out;
}

/* Copy the noted file `n` into the entries' directory, from the pages its reads brought in
 * (sendfile: what was not read is read now), those pages dropped after (the cache has the
 * bytes): named as entry `number` (the next the daemon handed: lane_numbers) and registered
 * as a backing file (id 0 if the kernel refuses it), what the daemon's loop would do per file
 * (coordlfs.cache.cache.WholeFileCache.adopt_copy); without a number, unnamed, for the daemon
 * to name. The note then holds the copy (-1 if the copy failed or the file is not the
 * version the row's opens read any more: the daemon backfills it itself, and meets the
 * failure there, a full cache filesystem noted by the cache), its number and its id. */
static void copy_note(struct note *n, int64_t number) {
    char name[24];
    int out = copy_file(number, name);
    if (out < 0)
        return;
    off_t at = 0;
    while (at < n->v.size) {
        ssize_t got = sendfile(out, n->fd, &at, (size_t)(n->v.size - at));
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            break;
    }
    struct stat st;
    if (at != n->v.size || fstat(n->fd, &st) != 0 || !shows_version(&st, &n->v)) {
        if (number >= 0)
            (void)unlinkat(copy_fd, name, 0);
        close(out);
        return;
    }
    (void)posix_fadvise(n->fd, 0, 0, POSIX_FADV_DONTNEED);
    atomic_fetch_add(&copies, 1);
    n->copy = out;
    if (number < 0)
        return;
    n->number = number;
    atomic_fetch_add(&copies_named, 1);
    struct backing_map map = {out, 0, 0};
    int id = ioctl(dev_fd, BACKING_OPEN, &map);
    n->backing = id > 0 ? id : 0;
}

/* Hand the copier entry numbers `first` .. `first + count - 1` for its copies' names (the
 * numbers it had left are not used). */
EXPORT void lane_numbers(int64_t first, int64_t count) {
    pthread_mutex_lock(&rows_lock);
    number_next = first;
    number_end = first + count;
    pthread_mutex_unlock(&rows_lock);
}

/* The entry numbers the copier has left (lane_numbers). */
EXPORT int64_t lane_numbers_left(void) {
    pthread_mutex_lock(&rows_lock);
    int64_t left = number_end - number_next;
    pthread_mutex_unlock(&rows_lock);
    return left;
}

/* The copier: each note's file copied before the daemon is handed it, in a thread of its
 * own (the lane's threads answer on meanwhile). */
static void *copier(void *unused) {
    (void)unused;
    for (;;) {
        pthread_mutex_lock(&rows_lock);
        while (!copying)
            pthread_cond_wait(&copy_wake, &rows_lock);
        struct note *n = copying;
        copying = n->next;
        if (!copying)
            copying_tail = NULL;
        /* taken now, under the lock held anyway (a copy that fails leaves a gap) */
        int64_t number = number_next < number_end ? number_next++ : -1;
        pthread_mutex_unlock(&rows_lock);
        n->copy = -1;
        copy_note(n, number);
        push_note(n);
    }
    return NULL;
}

/* Copy the files of notes into directory `dir_fd` (the cache's entries' files) before the
 * daemon is handed them, in a thread started now: the daemon then only adopts each copy as
 * its entry's file (coordlfs.fs.rows.LaneRows._noted). 0, or -errno. */
EXPORT int lane_copy_into(int dir_fd) {
    int fd = fcntl(dir_fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0)
        return -errno;
    pthread_mutex_lock(&rows_lock);
    int already = copy_fd >= 0;
    if (!already)
        copy_fd = fd;
    pthread_mutex_unlock(&rows_lock);
    if (already) {
        close(fd);
        return 0;
    }
    int rc;
    if (!spawn(copier, 1, &rc)) {
        pthread_mutex_lock(&rows_lock);
        copy_fd = -1;
        pthread_mutex_unlock(&rows_lock);
        close(fd);
        return -rc;
    }
    return 0;
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
    if (notes_fd < 0)
        notes_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    /* one open file: its flags are the session's too, whose loop no longer reads it */
    int flags = dev >= 0 ? fcntl(dev, F_GETFL) : -1;
    if (dev < 0 || root < 0 || efd < 0 || notes_fd < 0 || flags < 0 ||
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
    int rc;
    pthread_mutex_lock(&rows_lock); /* a thread that ends at once counts itself off after */
    int started = serving += spawn(serve, threads, &rc);
    pthread_mutex_unlock(&rows_lock);
    if (!started) {
        fcntl(dev, F_SETFL, flags);
        close(dev), close(root), close(efd);
        dev_fd = root_fd = wake_fd = -1;
        return -rc;
    }
    return efd;
}
