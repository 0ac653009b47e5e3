/* coordlfs preload library: the client's read path for unmodified programs.
 *
 * Why C, and why a preload: every open through a FUSE mount is a round trip to the daemon
 * (84 us of Python per cached file; even a C daemon bounds small files at a third to a half
 * of the kernel's rate). A process that opens the cache's own files reads at tmpfs speed,
 * but only Python code that imports coordlfs.client could, and TensorFlow's and torch's C++
 * readers never can. So, as DAOS's libpil4dfs and ORNL's HVAC do for HPC storage, this
 * library is preloaded into a job (`coordlfs run`, LD_PRELOAD) and answers read-only opens
 * of regular files under a coordlfs mount itself:
 *
 *   - a hit (published in the daemon's index, daemon beating, slot unchanged across the
 *     open) opens the cache entry's own file;
 *   - a miss the mount would serve from storage opens the source file, as the job's own
 *     user, beneath the source's root and without following a link; one the cache would
 *     keep is told to the daemon at its close (a datagram, never awaited), which copies the
 *     pages the job just read into the cache, as it does for a passthrough miss;
 *   - everything else (writes, O_PATH, directories, "..", a path not spelled under a mount,
 *     a stale or retired index, a mount with peers on a miss, any failure) goes to the real
 *     call, through the mount, which gives the same bytes or the same errno.
 *
 * The daemon user (and root) is served every cached file; another user of an --allow-other
 * mount only those every user may read (a second index, files of mode 0444:
 * coordlfs/cache/public.py), and of any other mount nothing: the cache directory is the
 * daemon user's, and their opens go through the mount, where the kernel checks them.
 * The library never widens access: before serving, it checks the modes the mount shows
 * (the source's, as default_permissions does) of every directory on the way and of the
 * file, unless the process may override them (CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH).
 *
 * The index layout and its rules are coordlfs/cache/published.py's (seqlock slots keyed by
 * BLAKE2b-128 of the path relative to the mount; header words: retired, revalidate, slots,
 * room, beat); the counters page is coordlfs/cache/preloaded.py's. Configuration comes from
 * COORDLFS_MOUNTS, which `coordlfs run` writes: records separated by \x1e, fields by \x1f:
 * mountpoint, cache directory, source, max file size, flags ("p": the mount has peers).
 *
 * Nothing here allocates or locks on the hot path; per-process state is inherited by fork
 * (descriptors, maps) and rebuilt after exec (every descriptor is O_CLOEXEC).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <linux/openat2.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))
#define MAX_MOUNTS 16
#define MAX_GROUPS 256
#define FD_SLOTS 65536
#define PENDING 16384

#include "../cache/published.h"

/* -- the counters page (coordlfs/cache/preloaded.py) ------------------------------------ */
static const char COUNTS_MAGIC[8] = {'C', 'L', 'F', 'S', 'P', 'R', 'E', '1'};
enum { HITS, HIT_BYTES, MISSES, MISS_BYTES, UNCACHED, UNCACHED_BYTES, PASSED, COUNTERS };
#define COUNTS_NAME "preload.counts"
#define NOTICE_NAME "preload.sock"

struct table {
    const unsigned char *map;
    size_t length;
    uint64_t mask;
    int public; /* the public index: only files every user may read */
};

struct mount {
    char *point;
    size_t point_len;
    char *cache_dir;
    char *source;
    uint64_t max_file;
    int peers;
    _Atomic int state; /* 0 not tried, 2 being set up, 1 ready, -1 off */
    int dir_fd, files_fd, source_fd, notice_fd;
    char source_real[PATH_MAX];
    size_t source_real_len;
    struct sockaddr_un notice_addr;
    socklen_t notice_addr_len;
    _Atomic(struct table *) table;
    _Atomic int reopening;
    _Atomic uint64_t *counts;
    pthread_mutex_t pending_lock;
    size_t pending_len;
    char pending[PENDING];
};

static struct mount mounts[MAX_MOUNTS];
static int mount_count;
/* fd -> 1 + the mount whose source file it is, to be filled behind at its close */
static _Atomic unsigned char behind[FD_SLOTS];

/* who this process is, for the modes' check: refreshed when the euid or egid changes */
static _Atomic int creds_state; /* 0 unknown, 1 known */
static uid_t creds_uid;
static gid_t creds_gid;
static int creds_override;
static int creds_ngroups;
static gid_t creds_groups[MAX_GROUPS];

/* -- the real calls --------------------------------------------------------------------- */
typedef int (*open_fn)(const char *, int, ...);
typedef int (*openat_fn)(int, const char *, int, ...);
typedef FILE *(*fopen_fn)(const char *, const char *);
typedef int (*close_fn)(int);
typedef int (*fclose_fn)(FILE *);
typedef int (*stat_fn)(const char *, struct stat *);
typedef int (*fstat_fn)(int, struct stat *);
typedef int (*fstatat_fn)(int, const char *, struct stat *, int);
static open_fn real_open, real_open64;
static openat_fn real_openat, real_openat64;
static fopen_fn real_fopen, real_fopen64;
static close_fn real_close;
static fclose_fn real_fclose;
static stat_fn real_stat, real_stat64, real_lstat, real_lstat64;
static fstat_fn real_fstat, real_fstat64;
static fstatat_fn real_fstatat, real_fstatat64;

/* Resolved again by whichever call comes first: a library's constructor may open a file
 * before ours runs (libselinux's, loaded by fio, calls fopen). */
static void find_real_calls(void)
{
    real_open = (open_fn)dlsym(RTLD_NEXT, "open");
    real_open64 = (open_fn)dlsym(RTLD_NEXT, "open64");
    real_openat = (openat_fn)dlsym(RTLD_NEXT, "openat");
    real_openat64 = (openat_fn)dlsym(RTLD_NEXT, "openat64");
    real_fopen = (fopen_fn)dlsym(RTLD_NEXT, "fopen");
    real_fopen64 = (fopen_fn)dlsym(RTLD_NEXT, "fopen64");
    real_close = (close_fn)dlsym(RTLD_NEXT, "close");
    real_fclose = (fclose_fn)dlsym(RTLD_NEXT, "fclose");
    real_stat = (stat_fn)dlsym(RTLD_NEXT, "stat");
    real_stat64 = (stat_fn)dlsym(RTLD_NEXT, "stat64");
    real_lstat = (stat_fn)dlsym(RTLD_NEXT, "lstat");
    real_lstat64 = (stat_fn)dlsym(RTLD_NEXT, "lstat64");
    real_fstat = (fstat_fn)dlsym(RTLD_NEXT, "fstat");
    real_fstat64 = (fstat_fn)dlsym(RTLD_NEXT, "fstat64");
    real_fstatat = (fstatat_fn)dlsym(RTLD_NEXT, "fstatat");
    real_fstatat64 = (fstatat_fn)dlsym(RTLD_NEXT, "fstatat64");
}

/* -- the index -------------------------------------------------------------------------- */

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* The index in the cache directory, mapped read-only; NULL if it is not one. The daemon
 * user's own index, else (another user of an --allow-other mount) the public one, which
 * holds only the files every user may read. */
static struct table *map_table(struct mount *m)
{
    int public = 0;
    int fd = real_openat(m->dir_fd, "published", O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0 && errno == EACCES) {
        public = 1;
        fd = real_openat(m->dir_fd, "published.public", O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    }
    if (fd < 0)
        return NULL;
    struct stat st;
    struct table *t = NULL;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size >= HEADER_SIZE) {
        void *map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
        if (map != MAP_FAILED) {
            const unsigned char *p = map;
            uint64_t slots = index_slots(p, (size_t)st.st_size);
            if (slots && (t = malloc(sizeof *t)) != NULL) {
                t->map = p;
                t->length = (size_t)st.st_size;
                t->mask = slots - 1;
                t->public = public;
            } else {
                munmap(map, (size_t)st.st_size);
            }
        }
    }
    real_close(fd);
    return t;
}

/* The table to read, NULL while the index may not be trusted: retired (a newer one is
 * mapped in its place; the old map is kept, as another thread may be reading it) or a
 * daemon that has not beaten for STALE_NS (dead or stopped: it withdraws nothing). */
static struct table *live_table(struct mount *m)
{
    for (int attempt = 0; attempt < 2; attempt++) {
        struct table *t = atomic_load_explicit(&m->table, memory_order_acquire);
        if (!word_at(t->map, RETIRED_AT)) {
            uint64_t beat = word_at(t->map, BEAT_AT);
            /* signed: a beat a nanosecond ahead (its flag bit) is fresh, not 584 years old */
            if (!(beat & BEAT_SET) || (int64_t)(now_ns() - beat) >= (int64_t)STALE_NS) {
                return NULL; /* an index without a beat is an older daemon's: not ours */
            }
            return t;
        }
        int expected = 0;
        if (!atomic_compare_exchange_strong(&m->reopening, &expected, 1))
            return NULL; /* another thread is at it: this open goes through the mount */
        struct table *fresh = map_table(m);
        if (fresh != NULL)
            atomic_store_explicit(&m->table, fresh, memory_order_release);
        atomic_store(&m->reopening, 0);
        if (fresh == NULL)
            return NULL;
    }
    return NULL;
}


/* -- setting a mount up, once per process (lazily: most processes never touch one) ------- */
static int mount_counts(struct mount *m)
{
    int fd = real_openat(m->dir_fd, COUNTS_NAME, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        return -1;
    struct stat st;
    void *map = MAP_FAILED;
    size_t length = 8 * (COUNTERS + 1);
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && (size_t)st.st_size >= length)
        map = mmap(NULL, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    real_close(fd);
    if (map == MAP_FAILED)
        return -1;
    if (memcmp(map, COUNTS_MAGIC, 8) != 0) {
        munmap(map, length);
        return -1;
    }
    m->counts = (_Atomic uint64_t *)map + 1;
    return 0;
}

static int set_up(struct mount *m)
{
    m->dir_fd = m->files_fd = m->source_fd = m->notice_fd = -1;
    /* O_PATH: another user of an --allow-other mount may search these, not list them */
    m->dir_fd = real_open(m->cache_dir, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (m->dir_fd < 0)
        return -1; /* not this user's: every open goes through the mount */
    m->files_fd = real_openat(m->dir_fd, "files", O_PATH | O_DIRECTORY | O_NOFOLLOW |
                                                   O_CLOEXEC);
    if (m->files_fd < 0 || mount_counts(m) < 0)
        return -1;
    /* a user who may not reach the source (another user's, behind a closed directory) is
     * served the public hits only; its misses go through the mount */
    m->source_fd = real_open(m->source, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (m->source_fd >= 0) {
        char link[64];
        snprintf(link, sizeof link, "/proc/self/fd/%d", m->source_fd);
        ssize_t n = readlink(link, m->source_real, sizeof m->source_real - 1);
        if (n <= 0)
            return -1;
        m->source_real[n] = 0;
        m->source_real_len = (size_t)n;
    }
    struct table *t = map_table(m);
    if (t == NULL)
        return -1;
    if ((word_at(t->map, BEAT_AT) & ~BEAT_SET) > (now_ns() | BEAT_SET)) {
        return -1; /* a clock ahead of ours (another time namespace): a dead daemon's beat
                      would look fresh */
    }
    atomic_store(&m->table, t);
    m->notice_addr.sun_family = AF_UNIX;
    int length = snprintf(m->notice_addr.sun_path, sizeof m->notice_addr.sun_path,
                          "/proc/self/fd/%d/" NOTICE_NAME, m->dir_fd);
    m->notice_addr_len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + length + 1);
    return 0;
}

/* What a set-up that failed had opened: closed (the mount goes through the kernel). */
static void tear_down(struct mount *m)
{
    int *fds[] = {&m->dir_fd, &m->files_fd, &m->source_fd};
    for (size_t i = 0; i < sizeof fds / sizeof *fds; i++) {
        if (*fds[i] >= 0)
            real_close(*fds[i]);
        *fds[i] = -1;
    }
}

/* The mount, set up in this process at its first open (other threads wait for that: it is
 * a few system calls); NULL where it cannot be served. */
static struct mount *ready(struct mount *m)
{
    static __thread int setting_up; /* an open from a signal handler during the set-up */
    int state = atomic_load_explicit(&m->state, memory_order_acquire);
    if (state == 1)
        return m;
    if (state == -1 || setting_up)
        return NULL;
    int expected = 0;
    if (atomic_compare_exchange_strong(&m->state, &expected, 2)) {
        setting_up = 1;
        int done = set_up(m);
        if (done != 0)
            tear_down(m);
        atomic_store_explicit(&m->state, done == 0 ? 1 : -1, memory_order_release);
        setting_up = 0;
    }
    while ((state = atomic_load_explicit(&m->state, memory_order_acquire)) == 2)
        sched_yield();
    return state == 1 ? m : NULL;
}

/* -- the modes' check, as the mount's kernel does it ------------------------------------ */
static int overrides_modes(void)
{
    int fd = real_open("/proc/self/status", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    char buf[4096];
    ssize_t n = read(fd, buf, sizeof buf - 1);
    real_close(fd);
    if (n <= 0)
        return 0;
    buf[n] = 0;
    char *line = strstr(buf, "\nCapEff:");
    return line != NULL && (strtoull(line + 8, NULL, 16) & 0x6) != 0;
}

static void know_creds(void)
{
    uid_t uid = geteuid();
    gid_t gid = getegid();
    if (atomic_load_explicit(&creds_state, memory_order_acquire) && uid == creds_uid &&
        gid == creds_gid)
        return;
    creds_override = overrides_modes();
    int n = getgroups(MAX_GROUPS, creds_groups);
    creds_ngroups = n < 0 ? 0 : n;
    creds_uid = uid;
    creds_gid = gid;
    atomic_store_explicit(&creds_state, 1, memory_order_release);
}

static int grants(const struct stat *st, int bit)
{
    if (st->st_uid == creds_uid)
        return (st->st_mode & (bit << 6)) != 0;
    int member = st->st_gid == creds_gid;
    for (int i = 0; !member && i < creds_ngroups; i++)
        member = st->st_gid == creds_groups[i];
    if (member)
        return (st->st_mode & (bit << 3)) != 0;
    return (st->st_mode & bit) != 0;
}

/* Whether the mount would let this process read `name` (relative to the source root,
 * whose lstat is `st`): search on the root and on every directory on the way, read on the
 * file. One fstatat per directory, none as root. The open's `know_creds` came first. */
static int mount_allows(struct mount *m, char *name, size_t length, const struct stat *st)
{
    if (creds_override)
        return 1;
    struct stat dir;
    if (!grants(st, 4) || fstat(m->source_fd, &dir) != 0 || !grants(&dir, 1))
        return 0;
    for (size_t i = 0; i < length; i++) {
        if (name[i] != '/')
            continue;
        name[i] = 0;
        int ok = fstatat(m->source_fd, name, &dir, AT_SYMLINK_NOFOLLOW) == 0 &&
                 grants(&dir, 1);
        name[i] = '/';
        if (!ok)
            return 0;
    }
    return 1;
}

/* -- deciding an open ------------------------------------------------------------------- */
/* Flags an open may carry and still be ours: read-only, nothing the cache's file or the
 * source file would answer differently from the mount. */
#define OURS (O_CLOEXEC | O_LARGEFILE | O_NOCTTY | O_NONBLOCK | O_NOFOLLOW)

/* `path` spelled under a mount: the mount and the name relative to its root (copied into
 * `name`), or NULL. Only plain names: no ".", "..", "//" or trailing "/". */
static struct mount *under_mount(const char *path, char name[PATH_MAX], size_t *length)
{
    char joined[PATH_MAX];
    if (path[0] != '/') {
        if (getcwd(joined, sizeof joined) == NULL)
            return NULL;
        size_t cwd = strlen(joined);
        size_t rest = strlen(path);
        if (cwd + 1 + rest >= sizeof joined)
            return NULL;
        joined[cwd] = '/';
        memcpy(joined + cwd + 1, path, rest + 1);
        path = joined;
    }
    for (int i = 0; i < mount_count; i++) {
        struct mount *m = &mounts[i];
        if (strncmp(path, m->point, m->point_len) != 0 || path[m->point_len] != '/')
            continue;
        const char *rel = path + m->point_len + 1;
        size_t n = strlen(rel);
        if (n == 0 || n >= PATH_MAX || rel[n - 1] == '/')
            return NULL;
        for (const char *c = rel; *c; c++) {
            if (c[0] == '/' && c[1] == '/')
                return NULL;
            if ((c == rel || c[-1] == '/') && c[0] == '.' &&
                (c[1] == '/' || c[1] == 0 || (c[1] == '.' && (c[2] == '/' || c[2] == 0))))
                return NULL;
        }
        memcpy(name, rel, n + 1);
        *length = n;
        return m;
    }
    return NULL;
}

static void count(struct mount *m, int files, int bytes, uint64_t size)
{
    atomic_fetch_add_explicit(&m->counts[files], 1, memory_order_relaxed);
    if (bytes >= 0)
        atomic_fetch_add_explicit(&m->counts[bytes], size, memory_order_relaxed);
}

static void mark_behind(int fd, int mount)
{
    if (fd >= 0 && fd < FD_SLOTS)
        atomic_store_explicit(&behind[fd], (unsigned char)mount, memory_order_relaxed);
}

/* -- what a served descriptor says it is ------------------------------------------------ */
/* fstat of a served descriptor shows the cache's file or the source's, not the mount's
 * inode. A program that stats a path, opens it and compares the two (cp: "replaced while
 * being copied") is told what its stat saw: the last stat of a file under a mount in each
 * thread is remembered, and an open of the same path and version takes it over, so fstat of
 * that descriptor answers the mount's device, inode, mode, owner and times. */
struct seen {
    int mount; /* 1 + the mount; 0: none */
    struct stat st;
    size_t length;
    char name[PATH_MAX]; /* kept, not hashed: most stats are followed by no open */
};
static __thread struct seen last_seen;
static struct stat shown[FD_SLOTS];
static _Atomic unsigned char shown_set[FD_SLOTS];

static int64_t ns_of(struct timespec t) { return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec; }

static void remember(int dirfd, const char *path, const struct stat *st)
{
    if (mount_count == 0 || !S_ISREG(st->st_mode) || !(path[0] == '/' || dirfd == AT_FDCWD))
        return;
    char name[PATH_MAX];
    size_t length;
    struct mount *m = under_mount(path, name, &length);
    if (m == NULL)
        return;
    memcpy(last_seen.name, name, length);
    last_seen.length = length;
    last_seen.st = *st;
    last_seen.mount = (int)(m - mounts) + 1;
}

/* The descriptor `fd` just opened for `h` of `m`, whose file is of this version. */
static void show(int fd, struct mount *m, const char *name, size_t length, uint64_t size,
                 int64_t mtime_ns, int64_t ctime_ns)
{
    if (fd >= FD_SLOTS)
        return;
    const struct seen *seen = &last_seen;
    int same = seen->mount == (int)(m - mounts) + 1 && seen->length == length &&
               memcmp(seen->name, name, length) == 0 && (uint64_t)seen->st.st_size == size &&
               ns_of(seen->st.st_mtim) == mtime_ns && ns_of(seen->st.st_ctim) == ctime_ns;
    if (same)
        shown[fd] = seen->st;
    atomic_store_explicit(&shown_set[fd], (unsigned char)same, memory_order_release);
}

static void forget_shown(int fd)
{
    if (fd >= 0 && fd < FD_SLOTS)
        atomic_store_explicit(&shown_set[fd], 0, memory_order_relaxed);
}

/* fstat's answer for a served descriptor: its size and blocks, the rest the mount's. */
static void as_shown(int fd, struct stat *st)
{
    if (fd < 0 || fd >= FD_SLOTS || !atomic_load_explicit(&shown_set[fd], memory_order_acquire))
        return;
    const struct stat *seen = &shown[fd];
    st->st_dev = seen->st_dev;
    st->st_ino = seen->st_ino;
    st->st_mode = seen->st_mode;
    st->st_nlink = seen->st_nlink;
    st->st_uid = seen->st_uid;
    st->st_gid = seen->st_gid;
    st->st_atim = seen->st_atim;
    st->st_mtim = seen->st_mtim;
    st->st_ctim = seen->st_ctim;
}

/* A hit: the entry's own file, if the slot still says so once it is open. */
static int open_hit(struct mount *m, const struct table *t, const struct found *f,
                    char *name, size_t length, int flags)
{
    struct stat st;
    /* The modes' check needs the source's lstat (but for a file of the public index, which
     * the daemon publishes there only when every user may read it); so does a daemon that
     * cannot watch the source. */
    if (word_at(t->map, REVALIDATE_AT) || !(creds_override || t->public)) {
        if (m->source_fd < 0 || fstatat(m->source_fd, name, &st, AT_SYMLINK_NOFOLLOW) != 0)
            return -1;
        if ((uint64_t)st.st_ino != f->ino || (uint64_t)st.st_size != f->size ||
            (int64_t)st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec != f->mtime_ns ||
            (int64_t)st.st_ctim.tv_sec * 1000000000 + st.st_ctim.tv_nsec != f->ctime_ns)
            return -1;
        if (!mount_allows(m, name, length, &st))
            return -1;
    }
    char file[24];
    snprintf(file, sizeof file, "%llx", (unsigned long long)f->number);
    int fd = real_openat(m->files_fd, file, O_RDONLY | O_NOFOLLOW | (flags & OURS));
    if (fd < 0)
        return -1;
    if (word_at(t->map, f->at) != f->word) { /* withdrawn meanwhile: not that file now */
        real_close(fd);
        return -1;
    }
    mark_behind(fd, 0);
    show(fd, m, name, length, f->size, f->mtime_ns, f->ctime_ns);
    count(m, HITS, HIT_BYTES, f->size);
    return fd;
}

/* A miss the mount would read from storage: the source file, as this process. */
static int open_miss(struct mount *m, const struct table *t, char *name, size_t length,
                     int flags)
{
    uint64_t room = word_at(t->map, ROOM_AT);
    if (m->peers || !(room & ROOM_SET) || m->source_fd < 0)
        return -1; /* a peer may hold it / a daemon that does not say: the mount decides */
    struct open_how how = {
        .flags = (uint64_t)(O_RDONLY | O_NOFOLLOW | (flags & OURS)),
        .resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS |
                   RESOLVE_NO_XDEV,
    };
    int fd = (int)syscall(SYS_openat2, m->source_fd, name, &how, sizeof how);
    if (fd < 0)
        return -1;
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || !mount_allows(m, name, length, &st)) {
        real_close(fd);
        return -1;
    }
    uint64_t size = (uint64_t)st.st_size;
    show(fd, m, name, length, size, ns_of(st.st_mtim), ns_of(st.st_ctim));
    if (size <= (room & ~ROOM_SET) && size <= m->max_file) {
        mark_behind(fd, (int)(m - mounts) + 1);
        count(m, MISSES, MISS_BYTES, size);
    } else {
        mark_behind(fd, 0);
        count(m, UNCACHED, UNCACHED_BYTES, size);
    }
    return fd;
}

/* The descriptor this library answers an open with, or -1 for the real call. */
static int served(const char *path, int flags)
{
    if (mount_count == 0 || path == NULL || (flags & ~OURS & ~O_ACCMODE) ||
        (flags & O_ACCMODE) != O_RDONLY)
        return -1;
    char name[PATH_MAX];
    size_t length;
    struct mount *m = under_mount(path, name, &length);
    if (m == NULL || (m = ready(m)) == NULL)
        return -1;
    struct table *t = live_table(m);
    int fd = -1;
    if (t != NULL) {
        know_creds();
        uint64_t h[2];
        struct found f;
        path_hash(name, length, h);
        if (index_probe(t->map, t->mask, h, &f))
            fd = open_hit(m, t, &f, name, length, flags);
        else
            fd = open_miss(m, t, name, length, flags);
    }
    if (fd < 0)
        count(m, PASSED, -1, 0);
    return fd;
}

/* Names to be filled go NUL-separated over a stream connection of this process's own
 * (made at its first name; a forked child makes its own): the kernel buffers a few hundred
 * KiB of them, where a datagram socket would queue only net.unix.max_dgram_qlen (10)
 * datagrams. Nothing waits: a name the connection cannot take now stays in the mount's
 * `pending` for the next close, and one that finds no room there is lost (a later epoch
 * misses it again: never a read lost). */
static int connect_notices(struct mount *m)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd >= 0 && connect(fd, (struct sockaddr *)&m->notice_addr, m->notice_addr_len) != 0 &&
        errno != EINPROGRESS) {
        real_close(fd);
        fd = -1;
    }
    return fd;
}

static void send_pending(struct mount *m, const char *rel, size_t length)
{
    /* another thread's turn is a copy and a send that never blocks: waited for; the same
     * thread again (a close in a signal handler that interrupted this) loses its name */
    static __thread int sending;
    if (sending)
        return;
    sending = 1;
    pthread_mutex_lock(&m->pending_lock);
    if (m->pending_len + length + 1 <= PENDING) {
        memcpy(m->pending + m->pending_len, rel, length);
        m->pending_len += length + 1;
        m->pending[m->pending_len - 1] = 0;
    }
    if (m->notice_fd < 0)
        m->notice_fd = connect_notices(m);
    if (m->notice_fd >= 0) {
        ssize_t sent = send(m->notice_fd, m->pending, m->pending_len,
                            MSG_DONTWAIT | MSG_NOSIGNAL);
        if (sent > 0) {
            memmove(m->pending, m->pending + sent, m->pending_len - (size_t)sent);
            m->pending_len -= (size_t)sent;
        } else if (sent < 0 && errno != EAGAIN) { /* the daemon went: a new one next time */
            real_close(m->notice_fd);
            m->notice_fd = -1;
        }
    }
    pthread_mutex_unlock(&m->pending_lock);
    sending = 0;
}

/* At the close of a miss the cache would keep: the daemon copies the pages just read. */
static void tell_behind(int fd)
{
    if (fd < 0 || fd >= FD_SLOTS)
        return;
    int mount = atomic_exchange_explicit(&behind[fd], 0, memory_order_relaxed);
    if (mount == 0)
        return;
    struct mount *m = &mounts[mount - 1];
    char link[64], target[PATH_MAX];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    int saved = errno;
    ssize_t n = readlink(link, target, sizeof target);
    if (n > (ssize_t)m->source_real_len + 1 && n < (ssize_t)sizeof target &&
        memcmp(target, m->source_real, m->source_real_len) == 0 &&
        target[m->source_real_len] == '/')
        send_pending(m, target + m->source_real_len + 1, (size_t)n - m->source_real_len - 1);
    errno = saved;
}

/* In a forked child: the parent's connection and names are the parent's (two writers on
 * one stream could interleave), and a lock, a set-up or a reopening a thread of the parent
 * held is nobody's (the child has one thread): made anew. */
static void forked(void)
{
    for (int i = 0; i < mount_count; i++) {
        struct mount *m = &mounts[i];
        if (m->notice_fd >= 0)
            real_close(m->notice_fd);
        m->notice_fd = -1;
        m->pending_len = 0;
        pthread_mutex_init(&m->pending_lock, NULL);
        /* a set-up or a reopening a thread of the parent was in the middle of: done again */
        int setting_up = 2;
        atomic_compare_exchange_strong(&m->state, &setting_up, 0);
        atomic_store(&m->reopening, 0);
    }
}

/* -- configuration ---------------------------------------------------------------------- */
/* Adds the mounts of `records` (COORDLFS_MOUNTS's format); how many there are now. */
static int add_mounts(const char *records)
{
    char *copy = strdup(records);
    for (char *record = copy; record != NULL && mount_count < MAX_MOUNTS;) {
        char *next = strchr(record, '\x1e');
        if (next != NULL)
            *next++ = 0;
        char *field[5] = {0};
        char *at = record;
        for (int i = 0; i < 5 && at != NULL; i++) {
            field[i] = at;
            at = strchr(at, '\x1f');
            if (at != NULL)
                *at++ = 0;
        }
        if (field[4] != NULL && field[0][0] == '/' && field[1][0] == '/' &&
            field[2][0] == '/') {
            struct mount *m = &mounts[mount_count];
            pthread_mutex_init(&m->pending_lock, NULL);
            m->dir_fd = m->files_fd = m->source_fd = m->notice_fd = -1; /* none open yet */
            m->point = field[0];
            m->point_len = strlen(field[0]);
            while (m->point_len > 1 && m->point[m->point_len - 1] == '/')
                m->point[--m->point_len] = 0;
            m->cache_dir = field[1];
            m->source = field[2];
            m->max_file = strtoull(field[3], NULL, 10);
            m->peers = strchr(field[4], 'p') != NULL;
            mount_count++;
        }
        record = next;
    }
    return mount_count;
}

__attribute__((constructor)) static void configure(void)
{
    find_real_calls();
    pthread_atfork(NULL, NULL, forked);
    const char *env = getenv("COORDLFS_MOUNTS");
    if (env != NULL && real_open != NULL && real_openat != NULL && real_close != NULL)
        add_mounts(env);
}

/* For the tests that hold the library's rules against coordlfs.cache.published's (loaded
 * with ctypes, not preloaded): mounts added by hand, before any open. */
EXPORT int coordlfs_configure(const char *records)
{
    find_real_calls();
    return add_mounts(records);
}

/* -- the intercepted calls -------------------------------------------------------------- */
static int mode_of(int flags, va_list ap)
{
    return (flags & (O_CREAT | O_TMPFILE)) ? va_arg(ap, int) : 0;
}

#define OPEN_BODY(real, ...)                                                              \
    do {                                                                                  \
        if (real == NULL)                                                                 \
            find_real_calls();                                                            \
        int fd = served(path, flags);                                                     \
        if (fd >= 0)                                                                      \
            return fd;                                                                    \
        fd = real(__VA_ARGS__);                                                           \
        mark_behind(fd, 0);                                                               \
        forget_shown(fd);                                                                 \
        return fd;                                                                        \
    } while (0)

EXPORT int open(const char *path, int flags, ...)
{
    va_list ap;
    va_start(ap, flags);
    int mode = mode_of(flags, ap);
    va_end(ap);
    OPEN_BODY(real_open, path, flags, mode);
}

EXPORT int open64(const char *path, int flags, ...)
{
    va_list ap;
    va_start(ap, flags);
    int mode = mode_of(flags, ap);
    va_end(ap);
    OPEN_BODY(real_open64, path, flags, mode);
}

/* openat: ours only for a path that does not depend on the directory descriptor */
static int served_at(int dirfd, const char *path, int flags)
{
    return (path != NULL && (path[0] == '/' || dirfd == AT_FDCWD)) ? served(path, flags) : -1;
}

#define OPENAT_BODY(real)                                                                 \
    do {                                                                                  \
        if (real == NULL)                                                                 \
            find_real_calls();                                                            \
        int fd = served_at(dirfd, path, flags);                                           \
        if (fd >= 0)                                                                      \
            return fd;                                                                    \
        fd = real(dirfd, path, flags, mode);                                              \
        mark_behind(fd, 0);                                                               \
        forget_shown(fd);                                                                 \
        return fd;                                                                        \
    } while (0)

EXPORT int openat(int dirfd, const char *path, int flags, ...)
{
    va_list ap;
    va_start(ap, flags);
    int mode = mode_of(flags, ap);
    va_end(ap);
    OPENAT_BODY(real_openat);
}

EXPORT int openat64(int dirfd, const char *path, int flags, ...)
{
    va_list ap;
    va_start(ap, flags);
    int mode = mode_of(flags, ap);
    va_end(ap);
    OPENAT_BODY(real_openat64);
}

/* the fortified forms (_FORTIFY_SOURCE) glibc routes an open without a mode through */
EXPORT int __open_2(const char *path, int flags) { return open(path, flags); }
EXPORT int __open64_2(const char *path, int flags) { return open64(path, flags); }
EXPORT int __openat_2(int dirfd, const char *path, int flags)
{
    return openat(dirfd, path, flags);
}
EXPORT int __openat64_2(int dirfd, const char *path, int flags)
{
    return openat64(dirfd, path, flags);
}

/* fopen's read-only modes ("r", "rb", "re", "rbe", ...): the open decided as above, the
 * stream made by fdopen; anything else is the real fopen's. */
static FILE *fopen_served(const char *path, const char *mode)
{
    if (mode == NULL || mode[0] != 'r' || strpbrk(mode, "+wax") != NULL)
        return NULL;
    int fd = served(path, O_RDONLY | (strchr(mode, 'e') ? O_CLOEXEC : 0));
    if (fd < 0)
        return NULL;
    FILE *f = fdopen(fd, "r");
    if (f == NULL) {
        tell_behind(fd);
        real_close(fd);
    }
    return f;
}

EXPORT FILE *fopen(const char *path, const char *mode)
{
    if (real_fopen == NULL)
        find_real_calls();
    FILE *f = fopen_served(path, mode);
    return f != NULL ? f : real_fopen(path, mode);
}

EXPORT FILE *fopen64(const char *path, const char *mode)
{
    if (real_fopen64 == NULL)
        find_real_calls();
    FILE *f = fopen_served(path, mode);
    return f != NULL ? f : real_fopen64(path, mode);
}

EXPORT int close(int fd)
{
    if (real_close == NULL)
        find_real_calls();
    tell_behind(fd);
    forget_shown(fd);
    return real_close(fd);
}

EXPORT int fclose(FILE *f)
{
    if (real_fclose == NULL)
        find_real_calls();
    if (f != NULL) {
        tell_behind(fileno(f));
        forget_shown(fileno(f));
    }
    return real_fclose(f);
}

/* The stat family: a file's stat under a mount is remembered (`remember`), a served
 * descriptor's is the mount's where its open took one over (`as_shown`). */
/* struct stat64 is struct stat on the 64-bit ABIs this is built for (checked below) */
_Static_assert(sizeof(struct stat64) == sizeof(struct stat), "stat64 is not stat");
#define STAT_PATH(name, type, real)                                                       \
    EXPORT int name(const char *path, struct type *st)                                    \
    {                                                                                     \
        if (real == NULL)                                                                 \
            find_real_calls();                                                            \
        int done = real(path, (struct stat *)st);                                         \
        if (done == 0)                                                                    \
            remember(AT_FDCWD, path, (struct stat *)st);                                  \
        return done;                                                                      \
    }
STAT_PATH(stat, stat, real_stat)
STAT_PATH(stat64, stat64, real_stat64)
STAT_PATH(lstat, stat, real_lstat)
STAT_PATH(lstat64, stat64, real_lstat64)

#define STAT_FD(name, type, real)                                                         \
    EXPORT int name(int fd, struct type *st)                                              \
    {                                                                                     \
        if (real == NULL)                                                                 \
            find_real_calls();                                                            \
        int done = real(fd, (struct stat *)st);                                           \
        if (done == 0)                                                                    \
            as_shown(fd, (struct stat *)st);                                              \
        return done;                                                                      \
    }
STAT_FD(fstat, stat, real_fstat)
STAT_FD(fstat64, stat64, real_fstat64)

#define STAT_AT(name, type, real)                                                         \
    EXPORT int name(int dirfd, const char *path, struct type *st, int flags)              \
    {                                                                                     \
        if (real == NULL)                                                                 \
            find_real_calls();                                                            \
        int done = real(dirfd, path, (struct stat *)st, flags);                           \
        if (done != 0)                                                                    \
            return done;                                                                  \
        if ((flags & AT_EMPTY_PATH) && path[0] == 0)                                      \
            as_shown(dirfd, (struct stat *)st);                                           \
        else                                                                              \
            remember(dirfd, path, (struct stat *)st);                                     \
        return done;                                                                      \
    }
STAT_AT(fstatat, stat, real_fstatat)
STAT_AT(fstatat64, stat64, real_fstatat64)
