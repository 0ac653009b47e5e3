/* coordlfs request lane: LOOKUPs of small files the daemon knows nothing of, answered in C.
 *
 * Why: a cold miss is LOOKUP + OPEN + RELEASE. The lane answers the OPEN and the RELEASE
 * (a source row, lane.c), but the LOOKUP was the Python loop's: 110-150 us of its CPU each,
 * most of a miss's (docs/design/lookup-lane.md).
 *
 * The daemon numbers its inodes by its table's rows, so a node answered here is numbered
 * here, in a space of its own (LANE_NODE set; the daemon's numbers never have it), and kept
 * here -- its key (dev, ino), path, the version shown, its lookups -- until the daemon adopts
 * it: when it first meets the number in a request it was handed, or the key (an inode it makes
 * or looks for: coordlfs/fs/lane_nodes.py, InodeTable). The node is then a row of the
 * daemon's table under this number, and its FORGETs are the daemon's. Until then they are
 * answered here, and a node the kernel forgets goes, with its row.
 *
 * Answered here is only what the daemon would answer alike with no decision of its own:
 * - a name in a directory the daemon offered (lane_directory): one it watches, so a change of
 *   the name reaches the kernel as an invalidation, as after the daemon's own answers;
 * - a plain name (not ".", "..", nor the control file's at the root), whose path opens
 *   beneath the source's root by the daemon's walk rules (no link, no other mount);
 * - a regular file of 1 byte to a row's largest, with no key the daemon holds (lane_hold):
 *   no inode of its (a hard link, a name dropped while its inode lived: one inode per key),
 *   no cache entry (complete or being filled: its open is a hit, or waits for the fill);
 * - when its opens can be offered a source row by the daemon's own rule
 *   (coordlfs.fs.rows._offer_source, lane_lookup_policy): kept by the cache at the last
 *   release the room takes it at, not kept when the cache never would.
 * Everything else goes to the daemon as before: a directory, a link, a missing name (its
 * negative entry), a larger file, a mount with peers, an aligned group.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "lane.h"

#define FUSE_LOOKUP 1
#define FUSE_FORGET 2
#define FUSE_BATCH_FORGET 42
/* The nodes numbered here (coordlfs.fs.lane_nodes.LANE_NODE); the open handles are another
 * bit (LANE_FH). */
#define LANE_NODE (1ULL << 62)
/* A row's path is shorter (coordlfs.fs.lane.MAX_PATH). */
#define ROW_PATH_MAX 1024

struct entry_out {
    uint64_t nodeid, generation, entry_valid, attr_valid;
    uint32_t entry_valid_nsec, attr_valid_nsec;
    struct attr attr;
};
struct forget_one {
    uint64_t nodeid, nlookup;
};
struct batch_forget_in {
    uint32_t count, dummy;
};

/* -- tables: chained, keyed by two words, grown by doubling -------------------------------- */

struct link {
    struct link *next;
    uint64_t a, b;
};
struct table {
    struct link **buckets;
    size_t n, count;
};

static struct link **where(const struct table *t, uint64_t a, uint64_t b) {
    uint64_t h = (a ^ (b * 0xC2B2AE3D27D4EB4FULL)) * 0x9E3779B97F4A7C15ULL;
    struct link **at = &t->buckets[h >> 32 & (t->n - 1)];
    while (*at && ((*at)->a != a || (*at)->b != b))
        at = &(*at)->next;
    return at;
}

static void *get(const struct table *t, uint64_t a, uint64_t b) {
    return t->n ? *where(t, a, b) : NULL;
}

/* `l` (absent) into `t`: 0, or -ENOMEM. */
static int put(struct table *t, struct link *l) {
    if (t->count >= t->n) {
        size_t n = t->n ? t->n * 2 : 1024;
        struct link **fresh = calloc(n, sizeof *fresh);
        if (!fresh)
            return -ENOMEM;
        struct table old = *t;
        t->buckets = fresh, t->n = n;
        for (size_t i = 0; i < old.n; i++)
            for (struct link *e = old.buckets[i], *next; e; e = next) {
                next = e->next;
                struct link **at = where(t, e->a, e->b);
                e->next = *at;
                *at = e;
            }
        free(old.buckets);
    }
    struct link **at = where(t, l->a, l->b);
    l->next = *at;
    *at = l;
    t->count++;
    return 0;
}

static void take_out(struct table *t, struct link *l) {
    *where(t, l->a, l->b) = l->next;
    t->count--;
}

/* -- what is kept ------------------------------------------------------------------------- */

/* A key (dev, ino): how many of the daemon's tables hold it (its inodes, the cache's
 * entries), and the node numbered here for it (0: none). */
struct key {
    struct link link; /* a: dev, b: ino */
    int64_t holds;
    uint64_t node;
};
/* A node numbered here, not adopted yet. */
struct node {
    struct link link; /* a: its number, b: 0 */
    uint64_t dev, ino;
    int64_t lookups, size, mtime_ns, ctime_ns;
    char path[];
};
/* A directory the daemon watches, and its path beneath the root. */
struct dir {
    struct link link; /* a: its node, b: 0 */
    char path[];
};

static struct table keys, nodes, dirs, handed;
static uint64_t numbered;
/* The nodes' allocations, kept as they come and go (the status reads it: no walk). */
static int64_t node_bytes;
/* lane_lookup_policy's: answer at all; the cache's --max-file-size, and whether a file over
 * it is the daemon's (until it said, once, that such files are not cached); a row's largest
 * file; the headroom the room keeps for the daemon's own reservations; whether the cache
 * keeps nothing; the room (lane_room); the control file's name at the root. Under the
 * mutex. */
static int lookups_on, over_max_to_daemon;
static int64_t max_file_size, row_max, headroom, room;
static int keeps_nothing;
static char control_name[NAME_MAX + 1];
static _Atomic uint64_t answered_lookups, answered_forgets;

void lookup_counts(uint64_t out[2]) {
    out[0] = atomic_load(&answered_lookups);
    out[1] = atomic_load(&answered_forgets);
}

/* The key entry goes if nothing keeps it. Under the mutex. */
static void settle(struct key *k) {
    if (!k->holds && !k->node) {
        take_out(&keys, &k->link);
        free(k);
    }
}

/* The node goes from here (adopted, or forgotten). Under the mutex. */
static void remove_node(struct node *n) {
    struct key *k = get(&keys, n->dev, n->ino);
    if (k) {
        k->node = 0;
        settle(k);
    }
    take_out(&nodes, &n->link);
    node_bytes -= (int64_t)malloc_usable_size(n) + MALLOC_HEADER;
    free(n);
}

/* -- the daemon's calls ------------------------------------------------------------------- */

/* Answer LOOKUPs (`on`) by the cache's rule: files to `max_size` bytes kept while the room
 * takes them (`nothing`: the cache keeps none), larger ones never (`over_max`: the daemon's),
 * rows for files to `largest` bytes, the last `spare` bytes of the room the daemon's to
 * reserve (room_for); the control file's `control` at the root is the daemon's. */
EXPORT void lane_lookup_policy(int on, int64_t max_size, int over_max, int64_t largest,
                               int64_t spare, int nothing, const char *control) {
    pthread_mutex_lock(&rows_lock);
    lookups_on = on, over_max_to_daemon = over_max;
    max_file_size = max_size, row_max = largest, headroom = spare, keeps_nothing = nothing;
    snprintf(control_name, sizeof control_name, "%s", control);
    pthread_mutex_unlock(&rows_lock);
}

/* The bytes the cache would still take now, by its capacity (whole pages, told at every change:
 * coordlfs.cache.room.Room.by_capacity); the files promised to it are taken from it here. */
EXPORT void lane_room(int64_t bytes) {
    pthread_mutex_lock(&rows_lock);
    room = bytes;
    pthread_mutex_unlock(&rows_lock);
}

static int hold_locked(uint64_t dev, uint64_t ino, int delta);

/* One of the daemon's tables holds key (dev, ino) (`delta` 1) or no longer (-1): a LOOKUP of
 * it is the daemon's while any does. 0, or -ENOMEM: then no LOOKUP is answered here again (a
 * hold not kept could give a key two inodes). */
EXPORT int lane_hold(uint64_t dev, uint64_t ino, int delta) {
    pthread_mutex_lock(&rows_lock);
    int rc = hold_locked(dev, ino, delta);
    pthread_mutex_unlock(&rows_lock);
    return rc;
}

static int hold_locked(uint64_t dev, uint64_t ino, int delta) {
    struct key *k = get(&keys, dev, ino);
    int rc = 0;
    if (!k && delta > 0) {
        if (!(k = calloc(1, sizeof *k)) || (k->link.a = dev, k->link.b = ino,
                                           put(&keys, &k->link) < 0)) {
            free(k);
            k = NULL;
            lookups_on = 0;
            rc = -ENOMEM;
        }
    }
    if (k) {
        k->holds += delta;
        if (k->holds < 0)
            k->holds = 0;
        settle(k);
    }
    return rc;
}

/* The node `n` (of key `k`) given to the daemon: its number, key, lookups, version, path. */
static void adopt(struct node *n, struct key *k, uint64_t *id, uint64_t key[2],
                  int64_t out[4], char *path, size_t cap) {
    *id = n->link.a;
    key[0] = n->dev, key[1] = n->ino;
    out[0] = n->lookups, out[1] = n->size, out[2] = n->mtime_ns, out[3] = n->ctime_ns;
    snprintf(path, cap, "%s", n->path);
    k->holds++; /* the daemon's inode now */
    remove_node(n);
}

/* The node numbered here for key (dev, ino) (`by_key`) or numbered `*id` (else), adopted by
 * the daemon: 1, its number in `*id`, key, lookups, version (size, mtime_ns, ctime_ns) and
 * path out (a row's path fits `cap` = ROW_PATH_MAX); 0 if there is none. With `hold` and
 * none, the daemon holds the key from now on (it makes an inode of it): at once, so that no
 * LOOKUP here numbers it meanwhile. -ENOMEM as lane_hold. */
EXPORT int lane_adopt(int by_key, uint64_t dev, uint64_t ino, int hold, uint64_t *id,
                      uint64_t key[2], int64_t out[4], char *path, size_t cap) {
    pthread_mutex_lock(&rows_lock);
    struct node *n = by_key ? NULL : get(&nodes, *id, 0);
    struct key *k = by_key ? get(&keys, dev, ino) : n ? get(&keys, n->dev, n->ino) : NULL;
    if (by_key && k && k->node)
        n = get(&nodes, k->node, 0);
    int rc = n && k;
    if (rc)
        adopt(n, k, id, key, out, path, cap);
    else if (by_key && hold) /* under the same mutex: no LOOKUP numbers it in between */
        rc = hold_locked(dev, ino, 1);
    pthread_mutex_unlock(&rows_lock);
    return rc;
}

/* Any node numbered here, adopted (lane_adopt's out): 1, or 0 when there is none. */
EXPORT int lane_adopt_any(uint64_t *id, uint64_t key[2], int64_t out[4], char *path,
                          size_t cap) {
    static size_t from; /* where the last one was: adopting all is one pass, not n */
    pthread_mutex_lock(&rows_lock);
    struct node *n = NULL;
    for (size_t i = 0; i < nodes.n && !n; i++)
        if ((n = (struct node *)nodes.buckets[(from + i) & (nodes.n - 1)]))
            from = (from + i) & (nodes.n - 1);
    struct key *k = n ? get(&keys, n->dev, n->ino) : NULL;
    int rc = n && k;
    if (rc)
        adopt(n, k, id, key, out, path, cap);
    pthread_mutex_unlock(&rows_lock);
    return rc;
}

/* Answer LOOKUPs of names in directory `nodeid`, at `path` beneath the root (the daemon
 * watches it): 0, or -ENOMEM, -ENAMETOOLONG (then they stay the daemon's). */
EXPORT int lane_directory(uint64_t nodeid, const char *path) {
    size_t plen = strlen(path);
    if (plen >= ROW_PATH_MAX)
        return -ENAMETOOLONG;
    pthread_mutex_lock(&rows_lock);
    struct dir *d = get(&dirs, nodeid, 0);
    int rc = 0;
    if (!d || strcmp(d->path, path)) {
        drop_directory_locked(nodeid);
        if (!(d = malloc(sizeof *d + plen + 1)) ||
            (d->link.a = nodeid, d->link.b = 0, memcpy(d->path, path, plen + 1),
             put(&dirs, &d->link) < 0)) {
            free(d);
            rc = -ENOMEM;
        }
    }
    pthread_mutex_unlock(&rows_lock);
    return rc;
}

void drop_directory_locked(uint64_t nodeid) {
    struct dir *d = get(&dirs, nodeid, 0);
    if (d) {
        take_out(&dirs, &d->link);
        free(d);
    }
}

/* No LOOKUP answered in any directory until the daemon offers it again (a directory was
 * renamed: paths beneath it changed; the source is no longer watched). */
EXPORT void lane_directories_clear(void) {
    pthread_mutex_lock(&rows_lock);
    for (size_t i = 0; i < dirs.n; i++)
        for (struct link *l = dirs.buckets[i], *next; l; l = next) {
            next = l->next;
            free(l);
        }
    free(dirs.buckets);
    dirs = (struct table){0};
    pthread_mutex_unlock(&rows_lock);
}

/* The number of the node numbered here for key (dev, ino), not adopted; 0 if there is none. */
EXPORT uint64_t lane_node_of(uint64_t dev, uint64_t ino) {
    pthread_mutex_lock(&rows_lock);
    struct key *k = get(&keys, dev, ino);
    uint64_t node = k ? k->node : 0;
    pthread_mutex_unlock(&rows_lock);
    return node;
}

/* The two words a path is kept under in `handed`: two 64-bit hashes of it (a collision
 * notes a file the room may not take, and the daemon's adoption checks the room again). */
static void path_words(const char *path, uint64_t *a, uint64_t *b) {
    uint64_t h1 = 0xcbf29ce484222325ULL, h2 = 0x9E3779B97F4A7C15ULL;
    for (const unsigned char *p = (const unsigned char *)path; *p; p++) {
        h1 = (h1 ^ *p) * 0x100000001b3ULL;
        h2 = (h2 ^ *p) * 0xC2B2AE3D27D4EB4FULL;
        h2 ^= h2 >> 31;
    }
    *a = h1, *b = h2;
}

/* The file at `path` (beneath the root) is handed to the fills (`on`: a prefetch that
 * promised it room, coordlfs.cache.fills.FillQueue.add) or no longer (its fill ended): a
 * source row of it is kept by the cache at its last release whatever the room, its room
 * being promised to it already (promise). So a reader that gets to a file before its fill
 * does hands the cache its own read at once; the fill, coming later, would find its pages
 * reclaimed and read storage again (pages go within seconds on a machine that pages cold
 * memory out). 0, or -ENOMEM (then the row is noted by the room alone, as before). */
EXPORT int lane_handed(const char *path, int on) {
    uint64_t a, b;
    path_words(path, &a, &b);
    pthread_mutex_lock(&rows_lock);
    struct link *l = get(&handed, a, b);
    int rc = 0;
    if (on && !l) {
        if (!(l = malloc(sizeof *l)) || (l->a = a, l->b = b, put(&handed, l) < 0)) {
            free(l);
            rc = -ENOMEM;
        }
    } else if (!on && l) {
        take_out(&handed, l);
        free(l);
    }
    pthread_mutex_unlock(&rows_lock);
    return rc;
}

int handed_locked(const char *path) {
    uint64_t a, b;
    if (!handed.count)
        return 0;
    path_words(path, &a, &b);
    return get(&handed, a, b) != NULL;
}

/* Nodes numbered here and not adopted; keys held or numbered; directories; the bytes a key
 * held takes (with its share of the table: what each inode and cache entry costs beside);
 * the bytes of all the nodes with their table (their share of what the inodes cost). */
EXPORT void lane_lookup_gauges(int64_t out[5]) {
    pthread_mutex_lock(&rows_lock);
    out[0] = (int64_t)nodes.count, out[1] = (int64_t)keys.count, out[2] = (int64_t)dirs.count;
    int64_t bytes = node_bytes + (int64_t)(nodes.n * sizeof *nodes.buckets);
    pthread_mutex_unlock(&rows_lock);
    out[3] = (int64_t)(sizeof(struct key) + MALLOC_HEADER + 2 * sizeof(void *));
    out[4] = bytes;
}

/* -- answers ------------------------------------------------------------------------------ */

int keep_for(int64_t size) {
    if (size > max_file_size)
        return over_max_to_daemon ? -1 : NOTE_NEVER;
    return keeps_nothing ? NOTE_NEVER : NOTE_KEEP;
}

int room_for(int64_t promised, int64_t pages) {
    if (promised + pages + headroom <= room)
        return 1;
    return promised + pages > room ? 0 : -1;
}

/* A node numbered now for the file `st` at `path` (its key `k`, NULL if none is kept yet),
 * with one lookup; NULL without memory. Under the mutex. */
static struct node *numbered_node(struct key *k, const struct stat *st,
                                  const int64_t version[STAT_FIELDS], const char *path) {
    struct node *n = malloc(sizeof *n + strlen(path) + 1);
    struct key *fresh = k ? NULL : calloc(1, sizeof *fresh);
    if (!n || (!k && !fresh)) {
        free(n), free(fresh);
        return NULL;
    }
    if (fresh) {
        fresh->link.a = (uint64_t)st->st_dev, fresh->link.b = (uint64_t)st->st_ino;
        if (put(&keys, &fresh->link) < 0) {
            free(n), free(fresh);
            return NULL;
        }
        k = fresh;
    }
    n->link.a = LANE_NODE | ++numbered, n->link.b = 0;
    n->dev = (uint64_t)st->st_dev, n->ino = (uint64_t)st->st_ino;
    n->lookups = 1, n->size = st->st_size, n->mtime_ns = version[3], n->ctime_ns = version[4];
    strcpy(n->path, path);
    if (put(&nodes, &n->link) < 0) {
        settle(k);
        free(n);
        return NULL;
    }
    k->node = n->link.a;
    node_bytes += (int64_t)malloc_usable_size(n) + MALLOC_HEADER;
    return n;
}

/* A LOOKUP of `name` in `parent`: answered (1), else 0. */
static int answer_lookup(const struct in_header *in, const char *name, size_t len) {
    size_t nlen = strnlen(name, len);
    uint64_t valid = atomic_load(&attr_valid_ns);
    if (!nlen || nlen == len || !valid || !strcmp(name, ".") || !strcmp(name, "..") ||
        memchr(name, '/', nlen))
        return 0;
    char path[ROW_PATH_MAX];
    pthread_mutex_lock(&rows_lock);
    struct dir *d = lookups_on && enabled ? get(&dirs, in->nodeid, 0) : NULL;
    int fits = d && (in->nodeid != 1 || strcmp(name, control_name)) &&
               snprintf(path, sizeof path, "%s%s%s", d->path, *d->path ? "/" : "", name) <
                   (int)sizeof path;
    pthread_mutex_unlock(&rows_lock);
    if (!fits)
        return 0;
    int fd = open_beneath(path, O_PATH);
    struct stat st;
    int ok = fd >= 0 && fstat(fd, &st) == 0;
    if (fd >= 0)
        close(fd);
    if (!ok || !S_ISREG(st.st_mode) || st.st_size <= 0)
        return 0;
    int64_t version[STAT_FIELDS] = {
        (int64_t)st.st_dev, (int64_t)st.st_ino, st.st_size,
        st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec,
        st.st_ctim.tv_sec * 1000000000LL + st.st_ctim.tv_nsec,
        st.st_atim.tv_sec * 1000000000LL + st.st_atim.tv_nsec, st.st_blocks, st.st_mode,
        (int64_t)st.st_nlink, st.st_uid, st.st_gid, (int64_t)st.st_rdev, st.st_blksize};
    uint64_t id = 0;
    pthread_mutex_lock(&rows_lock);
    struct key *k = get(&keys, (uint64_t)st.st_dev, (uint64_t)st.st_ino);
    struct node *n = k && k->node ? get(&nodes, k->node, 0) : NULL;
    int note = keep_for(st.st_size);
    if (!lookups_on || !enabled || st.st_size > row_max || note < 0 || (k && k->holds))
        ; /* the daemon's */
    else if (n) {
        /* looked up again (a name dropped, a hard link): while its row stands for this
         * version; else the daemon decides (it adopts the node: a changed file, held opens) */
        if (n->size == st.st_size && n->mtime_ns == version[3] && n->ctime_ns == version[4] &&
            offer_locked(n->link.a, 0, path, version, 1, note, -1) == 0) {
            n->lookups++;
            id = n->link.a;
        }
    } else if ((n = numbered_node(k, &st, version, path))) {
        if (offer_locked(n->link.a, 0, path, version, 1, note, -1) == 0)
            id = n->link.a;
        else
            remove_node(n); /* and its key, if nothing else keeps it */
    }
    pthread_mutex_unlock(&rows_lock);
    if (!id)
        return 0;
    struct entry_out out = {id, 0, valid / 1000000000u, valid / 1000000000u,
                            (uint32_t)(valid % 1000000000u), (uint32_t)(valid % 1000000000u),
                            {0}};
    attr_of(&out.attr, &st, id);
    atomic_fetch_add(&answered_lookups, 1);
    reply(in->unique, 0, &out, sizeof out);
    return 1;
}

/* The kernel drops `count` lookups of `nodeid`: 1 if the node is numbered here (it goes at
 * its last, with its row), else 0. Under the mutex. */
static int forget_locked(uint64_t nodeid, uint64_t count) {
    struct node *n = nodes.n ? get(&nodes, nodeid, 0) : NULL;
    if (!n)
        return 0;
    n->lookups -= (int64_t)count;
    if (n->lookups <= 0) {
        drop_locked(nodeid);
        remove_node(n);
    }
    atomic_fetch_add(&answered_forgets, 1);
    return 1;
}

int lookup_answered(char *mem, size_t len) {
    struct in_header *in = (void *)mem;
    char *arg = mem + sizeof *in;
    size_t rest = len - sizeof *in;
    if (in->opcode == FUSE_LOOKUP)
        return answer_lookup(in, arg, rest);
    if (in->opcode == FUSE_FORGET) {
        if (!(in->nodeid & LANE_NODE) || rest < sizeof(uint64_t))
            return 0; /* the daemon's */
        uint64_t count;
        memcpy(&count, arg, sizeof count);
        pthread_mutex_lock(&rows_lock);
        int ok = forget_locked(in->nodeid, count);
        pthread_mutex_unlock(&rows_lock);
        return ok; /* a FORGET has no reply */
    }
    if (in->opcode != FUSE_BATCH_FORGET || rest < sizeof(struct batch_forget_in))
        return 0;
    struct batch_forget_in *batch = (void *)arg;
    struct forget_one *one = (void *)(arg + sizeof *batch);
    uint32_t count = batch->count, kept = 0;
    if (count > (rest - sizeof *batch) / sizeof *one)
        return 0; /* torn: the daemon's to refuse */
    pthread_mutex_lock(&rows_lock);
    for (uint32_t i = 0; i < count; i++)
        if (!(one[i].nodeid & LANE_NODE) || !forget_locked(one[i].nodeid, one[i].nlookup))
            one[kept++] = one[i];
    pthread_mutex_unlock(&rows_lock);
    if (!kept)
        return 1;
    batch->count = kept;
    in->len = (uint32_t)(sizeof *in + sizeof *batch + kept * sizeof *one);
    return 0;
}
