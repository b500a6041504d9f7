/* UTF-8 validation and lossy repair, shared by every layer (tokenizer,
 * Engram token map, chat encoding, HTTP/JSON).  One definition of "valid"
 * everywhere: RFC 3629 (no overlongs, no surrogates, nothing above
 * U+10FFFF; NUL allowed), and one repair rule: each maximal ill-formed
 * subpart becomes one U+FFFD, as Rust's String::from_utf8_lossy and
 * Python's bytes.decode(errors="replace") do. */
#ifndef DS41_CONFIG_UTF8_H
#define DS41_CONFIG_UTF8_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Length (1..4) of the well-formed character starting at s[0] (len >= 1), or
 * 0 when none starts there; then *subpart (if not NULL) is the length of the
 * maximal ill-formed subpart at s[0] (>= 1). */
size_t ds41_utf8_sequence(const uint8_t *s, size_t len, size_t *subpart);

/* Length (1..4) of the well-formed character at s[0..len) and its code point in *cp; 0 (cp
 * untouched) when none starts there or len is 0. */
size_t ds41_utf8_decode(const uint8_t *s, size_t len, uint32_t *cp);

/* Whether s[0..len) (len >= 1) is a proper prefix of a well-formed character: a valid lead byte
 * followed only by acceptable continuation bytes, so that more bytes could complete it. */
bool ds41_utf8_truncated(const uint8_t *s, size_t len);

/* The longest prefix of s[0..len) of at most max bytes that does not end inside a character
 * (cuts back over continuation bytes; for well-formed text a character boundary). */
size_t ds41_utf8_cut(const char *s, size_t len, size_t max);

/* Whether s[0..len) is well-formed.  On false, *bad_offset (if not NULL) is
 * the offset of the first ill-formed sequence. */
bool ds41_utf8_valid(const char *s, size_t len, size_t *bad_offset);

/* Bytes of the longest well-formed prefix of s[0..len). */
size_t ds41_utf8_valid_prefix(const char *s, size_t len);

/* A malloc'd NUL-terminated copy of bytes[0..n) with every maximal
 * ill-formed subpart replaced by U+FFFD; *out_len (if not NULL) gets its
 * length.  NULL on out of memory. */
char *ds41_utf8_lossy(const uint8_t *bytes, size_t n, size_t *out_len);

/* Whether s[0..n) contains the encoded U+FFFD (EF BF BD). */
bool ds41_utf8_contains_replacement(const char *s, size_t n);

#endif
