/* What the request lane's two sources share (coordlfs/lane/lane.c: rows, opens, the queue to
 * the daemon; coordlfs/lane/lookup.c: LOOKUPs and FORGETs of the nodes it numbers): the
 * kernel's ABI, a row, and the lane's internals both call. Nothing here is exported from the
 * library (it is built with -fvisibility=hidden; EXPORT marks what the daemon calls).
 */
#ifndef COORDLFS_LANE_H
#define COORDLFS_LANE_H
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/types.h>

#define EXPORT __attribute__((visibility("default")))
/* glibc's bookkeeping per allocation, beside what malloc_usable_size says */
#define MALLOC_HEADER 8

/* -- the kernel's ABI (linux/fuse.h of 7.40; the system's header may be older) ------------ */
#define FUSE_GETATTR 3
#define FUSE_OPEN 14
#define FUSE_RELEASE 18
#define FUSE_IOCTL 39
#define FUSE_IOCTL_DIR (1u << 4)
#define FOPEN_NOFLUSH (1u << 5)
#define FOPEN_PASSTHROUGH (1u << 7)
struct backing_map {
    int32_t fd;
    uint32_t flags;
    uint64_t padding;
};
#define BACKING_OPEN _IOW(229, 1, struct backing_map)
#define BACKING_CLOSE _IOW(229, 2, uint32_t)

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
struct attr {
    uint64_t ino, size, blocks, atime, mtime, ctime;
    uint32_t atimensec, mtimensec, ctimensec, mode, nlink, uid, gid, rdev, blksize, flags;
};
struct attr_out {
    uint64_t attr_valid;
    uint32_t attr_valid_nsec, dummy;
    struct attr attr;
};
struct ioctl_in {
    uint64_t fh;
    uint32_t flags, cmd;
    uint64_t arg;
    uint32_t in_size, out_size;
};

/* What a row answers opens with, and the source file's version it stands for. */
struct version {
    uint64_t dev, ino;
    int64_t size, mtime_ns, ctime_ns;
    int32_t backing, zero; /* no padding: versions are compared with memcmp */
};

/* A row answers opens with a cache entry's file (its backing registered by the daemon), or
 * with the source file itself (`source`): a miss the kernel reads from the source, as
 * libfuse's passthrough_hp serves every open. A source row's file is opened and registered
 * here at the first of its opens, kept in `fd` while they last, and at the last release its
 * id closed; with `note`, the row then goes, and the file (still open) is handed to the
 * daemon (lane_note), which copies the pages the reads brought in into the cache. A row
 * that may be kept (`keep`) is noted so at its first open if the room the daemon told, less
 * the files noted and not yet handed over, takes it with the headroom to spare (room_for),
 * and at the last release only if it still does; a first open within the headroom is the
 * daemon's (it reserves at the open); else the row stays, read from the source, and is
 * decided again at its next first open (a full cache's misses, until room comes back). A row
 * the daemon `adopted` (it had to decide an open of the inode itself) is the daemon's: its
 * backing id and descriptor are, and so are its releases. A peer row (`peer`: the slot of the
 * lane's connection to the peer that caches the file, else -1) is a source row whose first
 * open's file is fetched from that peer and landed here (`fd`: the landed file), never noted:
 * the file is the peer's to cache. */
/* The attributes besides the version the source file had when the row was offered: what a
 * held open of an entry's or a peer's file shows (the daemon's getattr of an inode whose open
 * files read a fixed version), so that the daemon keeps nothing of its own per row. */
struct shown {
    int64_t atime_ns, blocks, mode, nlink, uid, gid, rdev, blksize;
};

/* The fields lane_offer takes and lane_suspend and lane_held_stat give, in this order: the
 * version's (without its backing), then the shown ones. */
#define STAT_FIELDS 13

/* What a row answers opens with; kinds as lane_suspend and lane_held_stat give them. */
enum { KIND_NONE, KIND_ENTRY, KIND_SOURCE, KIND_PEER };

struct row {
    struct row *next;
    uint64_t nodeid;
    /* handed: its file was handed to the fills at its first open (handed_locked) */
    int active, source, keep, note, noted, adopted, fd, peer, handed;
    int64_t opens;
    struct version v;
    struct shown shown;
    char path[];
};


/* -- lane.c's, for lookup.c ---------------------------------------------------------------- */

/* One mutex over the rows, the queue, and lookup.c's nodes, keys and directories. */
extern pthread_mutex_t rows_lock;
/* Whether opens (and LOOKUPs) are answered at all (lane_enable). */
extern int enabled;
/* How long the kernel may keep attributes and names the lane answers with (ns; 0: not set). */
extern _Atomic uint64_t attr_valid_ns;
/* Reply to request `unique` with `error`, or with `len` bytes at `arg`. */
void reply(uint64_t unique, int error, const void *arg, size_t len);
/* `path` (beneath the source's root) opened with `flags` by the daemon's walk rules (no link,
 * no other mount), or -1. */
int open_beneath(const char *path, int flags);
/* The kernel's attributes of node `nodeid` whose source file's are `st`. */
void attr_of(struct attr *out, const struct stat *st, uint64_t nodeid);
/* lane_offer under the mutex. */
int offer_locked(uint64_t nodeid, int32_t backing, const char *path,
                 const int64_t st[STAT_FIELDS], int source, int note, int peer);
/* The row of `nodeid` answers no more opens (it goes, or at the last release of those it
 * holds); the opens it holds. Under the mutex. */
int64_t drop_locked(uint64_t nodeid);

/* -- lookup.c's, for lane.c ---------------------------------------------------------------- */

/* What a source row of a file of `size` bytes is offered with, by the cache's rule
 * (lane_lookup_policy): NOTE_KEEP (kept at a last release the room takes it at), NOTE_NEVER
 * (read from the source for good), or -1 (the daemon's: it says once why it is not cached).
 * Under the mutex. */
enum { NOTE_NEVER, NOTE_KEEP };
int keep_for(int64_t size);
/* Whether the room the daemon told (lane_room) takes a file of `pages` beside the files
 * `promised` and not yet reserved: 1 if with the headroom to spare (the file is promised), 0
 * if not even without it (the cache is full for it: read from the source), -1 between (the
 * daemon reserves it at its open, so that the room clients read stays exact near full).
 * Under the mutex. */
int room_for(int64_t promised, int64_t pages);
/* Whether the file at `path` is handed to the fills and not filled yet (lane_handed).
 * Under the mutex. */
int handed_locked(const char *path);
/* What a file of `size` bytes takes of the room: whole pages, as the cache charges it
 * (coordlfs.sizes.pages). */
#define PAGE 4096
static inline int64_t pages_of(int64_t size) {
    return (size + PAGE - 1) / PAGE * PAGE;
}

/* A LOOKUP, FORGET or BATCH_FORGET (`mem`, `len` bytes): answered here (1), else 0 (the
 * daemon's; a BATCH_FORGET is then left with the daemon's nodes only, its header's length
 * saying how much of `mem` is left). */
int lookup_answered(char *mem, size_t len);
/* `nodeid` is forgotten: its directory row goes too. Under the mutex. */
void drop_directory_locked(uint64_t nodeid);
/* LOOKUPs and FORGETs answered: into out[0] and out[1]. */
void lookup_counts(uint64_t out[2]);

#endif
