/* The index of cached files the daemon publishes (coordlfs/cache/published.py), read in C:
 * its layout, the BLAKE2b-128 key of a path, and a probe of a slot under its seqlock.
 *
 * Why a header: two libraries read it, the preload library (coordlfs/preload/preload.c,
 * in a job's processes) and the peer server's C path (coordlfs/peers/serving.c, in the
 * daemon); each is built from its one source file by scripts/setup-c. Everything here is
 * static, so each library has its own copy and exports nothing of it.
 */
#ifndef COORDLFS_PUBLISHED_H
#define COORDLFS_PUBLISHED_H
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define HEADER_SIZE 64
#define SLOT_SIZE 64
#define RETIRED_AT 8
#define REVALIDATE_AT 16
#define SLOTS_AT 24
#define ROOM_AT 40
#define BEAT_AT 48
#define ROOM_SET (1ULL << 63)
#define BEAT_SET 1ULL
#define STALE_NS 2000000000ULL
#define LIVE 1
#define EMPTY 0
static const char INDEX_MAGIC[8] = {'C', 'L', 'F', 'S', 'I', 'D', 'X', '1'};

/* -- BLAKE2b-128, unkeyed (RFC 7693): the index's key, as hashlib.blake2b(digest_size=16).
 * Written here rather than linked: Debian's libb2 pulls libgomp into every process. */
static const uint64_t B2_IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL,
    0xa54ff53a5f1d36f1ULL, 0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL,
    0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};
static const uint8_t B2_SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

static inline uint64_t rotr64(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

#define B2_G(a, b, c, d, x, y)                                                            \
    do {                                                                                  \
        v[a] = v[a] + v[b] + (x); v[d] = rotr64(v[d] ^ v[a], 32);                         \
        v[c] = v[c] + v[d];       v[b] = rotr64(v[b] ^ v[c], 24);                         \
        v[a] = v[a] + v[b] + (y); v[d] = rotr64(v[d] ^ v[a], 16);                         \
        v[c] = v[c] + v[d];       v[b] = rotr64(v[b] ^ v[c], 63);                         \
    } while (0)

static void b2_compress(uint64_t h[8], const unsigned char block[128], uint64_t counted,
                        int last)
{
    uint64_t m[16], v[16];
    memcpy(m, block, 128); /* little-endian: x86-64 and aarch64 alike */
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = B2_IV[i];
    }
    v[12] ^= counted;
    if (last)
        v[14] = ~v[14];
    for (int r = 0; r < 12; r++) {
        const uint8_t *s = B2_SIGMA[r];
        B2_G(0, 4, 8, 12, m[s[0]], m[s[1]]);
        B2_G(1, 5, 9, 13, m[s[2]], m[s[3]]);
        B2_G(2, 6, 10, 14, m[s[4]], m[s[5]]);
        B2_G(3, 7, 11, 15, m[s[6]], m[s[7]]);
        B2_G(0, 5, 10, 15, m[s[8]], m[s[9]]);
        B2_G(1, 6, 11, 12, m[s[10]], m[s[11]]);
        B2_G(2, 7, 8, 13, m[s[12]], m[s[13]]);
        B2_G(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++)
        h[i] ^= v[i] ^ v[i + 8];
}

static void path_hash(const char *path, size_t length, uint64_t out[2])
{
    uint64_t h[8];
    unsigned char block[128];
    memcpy(h, B2_IV, sizeof h);
    h[0] ^= 0x01010000ULL ^ 16; /* no key, 16-byte digest */
    size_t done = 0;
    while (length - done > 128) {
        memcpy(block, path + done, 128);
        done += 128;
        b2_compress(h, block, done, 0);
    }
    memset(block, 0, sizeof block);
    memcpy(block, path + done, length - done);
    b2_compress(h, block, length, 1);
    out[0] = h[0];
    out[1] = h[1];
}

static inline uint64_t word_at(const unsigned char *map, size_t at)
{
    return atomic_load_explicit((_Atomic uint64_t *)(map + at), memory_order_acquire);
}

/* The slots of the index mapped at `p` (`length` bytes), 0 if it is not one: the magic, a
 * power of two of slots that fit. */
static uint64_t index_slots(const unsigned char *p, size_t length)
{
    if (length < HEADER_SIZE || memcmp(p, INDEX_MAGIC, 8))
        return 0;
    uint64_t slots = word_at(p, SLOTS_AT);
    return slots && !(slots & (slots - 1)) && slots <= (length - HEADER_SIZE) / SLOT_SIZE
               ? slots : 0;
}

struct found {
    uint64_t number, size, ino;
    int64_t mtime_ns, ctime_ns;
    size_t at;
    uint64_t word;
};

/* The live slot of hash `h` in the table mapped at `map` (`mask`: its slots - 1), copied
 * into `f`: 1, or 0 if there is none or it was rewritten while read (the caller asks the
 * daemon). */
static int index_probe(const unsigned char *map, uint64_t mask, const uint64_t h[2],
                       struct found *f)
{
    uint64_t slot = h[0] & mask;
    for (uint64_t n = 0; n <= mask; n++, slot = (slot + 1) & mask) {
        size_t at = HEADER_SIZE + slot * SLOT_SIZE;
        uint64_t word = word_at(map, at);
        if ((word & 3) == EMPTY)
            return 0;
        const volatile uint64_t *s = (const volatile uint64_t *)(map + at);
        if ((word & 3) != LIVE || s[1] != h[0] || s[2] != h[1])
            continue;
        f->number = s[3];
        f->size = s[4];
        f->ino = s[5];
        f->mtime_ns = (int64_t)s[6];
        f->ctime_ns = (int64_t)s[7];
        f->at = at;
        f->word = word;
        return word_at(map, at) == word; /* rewritten while read: the mount answers */
    }
    return 0;
}
#endif
