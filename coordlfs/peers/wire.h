/* The peer wire (coordlfs/peers/wire.py) in C: a frame's layout and the blocking sends and
 * receives of whole frames over a socket with SO_RCVTIMEO and SO_SNDTIMEO.
 *
 * Why a header: two libraries speak it, the request lane (coordlfs/lane/lane.c: a peer's file
 * asked for on the lane's own connections) and the peer server's C path
 * (coordlfs/peers/serving.c: those connections served); each is built from its one source file
 * by scripts/setup-c. Everything here is static.
 */
#ifndef COORDLFS_WIRE_H
#define COORDLFS_WIRE_H
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/types.h>
#include <time.h>

/* A frame's header (!4sBBIIQ: magic, version, kind, request id, payload length, XXH64), a
 * GET's (!QqQI: size, mtime_ns, offset, length), a path's bound, the most one GET asks for
 * (wire.MAX_CHUNK). */
#define FRAME_HEADER 22
#define GET_HEADER 28
#define PEER_PATH_MAX 4096
#define PEER_MAX (1 << 20)
enum { KIND_GET = 4, KIND_DATA = 5, KIND_FAIL = 6 };

static void put_be(unsigned char *at, uint64_t value, int bytes) {
    for (int i = bytes - 1; i >= 0; i--, value >>= 8)
        at[i] = (unsigned char)value;
}

static uint64_t get_be(const unsigned char *at, int bytes) {
    uint64_t value = 0;
    for (int i = 0; i < bytes; i++)
        value = value << 8 | at[i];
    return value;
}

/* A frame's header: `kind`, reply to or request `id`, `len` bytes of payload whose XXH64 is
 * `digest`. */
static void frame_header(unsigned char h[FRAME_HEADER], int kind, uint32_t id, uint64_t len,
                         uint64_t digest) {
    memcpy(h, "CLFP", 4);
    h[4] = 1, h[5] = (unsigned char)kind;
    put_be(h + 6, id, 4);
    put_be(h + 10, len, 4);
    put_be(h + 14, digest, 8);
}

/* What a failed send or receive of a whole frame says: the peer closed the connection
 * before any of the frame passed (its idle close crossed the request: no fault), or another
 * failure (a timeout, a close midway). */
enum { CLOSED_FIRST = -2, FAILED = -1 };

static int gone(ssize_t n, int untouched) {
    return untouched && (n == 0 || errno == ECONNRESET || errno == EPIPE) ? CLOSED_FIRST : FAILED;
}

static uint64_t monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* The clock of one frame's bytes, sent or received in one or more calls: the socket's
 * SO_RCVTIMEO (the peer timeout, which its owner set) from its first byte, as wire.py bounds a
 * frame. SO_RCVTIMEO and SO_SNDTIMEO bound each call only, so a peer that trickled a byte at a
 * time within them would hold the connection for ever without it. */
struct frame_clock {
    uint64_t timeout_ns, deadline; /* deadline 0: no byte yet */
};

static struct frame_clock frame_clock(int fd) {
    struct timeval tv = {0, 0};
    socklen_t size = sizeof tv;
    if (getsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, &size) || (!tv.tv_sec && !tv.tv_usec))
        tv.tv_sec = 60;
    return (struct frame_clock){(uint64_t)tv.tv_sec * 1000000000ULL + (uint64_t)tv.tv_usec * 1000,
                                0};
}

/* Whether the frame on `c` is past its time; its clock started if `moved` bytes just went. */
static int late(struct frame_clock *c, ssize_t moved) {
    uint64_t now = c->deadline || moved > 0 ? monotonic_ns() : 0;
    if (!c->deadline && moved > 0)
        c->deadline = now + c->timeout_ns;
    return c->deadline && now > c->deadline;
}

/* Move all `len` bytes of `mem` to (`sending`) or from the socket, within the frame's clock:
 * 0, or why not (closed, reset, SO_SNDTIMEO / SO_RCVTIMEO or the frame's time passed). */
static int whole(int fd, char *mem, size_t len, int flags, int sending, struct frame_clock *c) {
    size_t all = len;
    while (len) {
        if (late(c, 0))
            return FAILED;
        ssize_t n = sending ? send(fd, mem, len, MSG_NOSIGNAL | flags) : recv(fd, mem, len, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return gone(n, len == all && !c->deadline);
        late(c, n);
        mem += n, len -= (size_t)n;
    }
    return 0;
}

/* Send all `len` bytes (`flags`: MSG_MORE when more of the frame follows). */
static int send_all(int fd, const void *mem, size_t len, int flags, struct frame_clock *c) {
    return whole(fd, (char *)mem, len, flags, 1, c);
}

/* Receive exactly `len` bytes. */
static int recv_all(int fd, void *mem, size_t len, struct frame_clock *c) {
    return whole(fd, mem, len, 0, 0, c);
}
#endif
