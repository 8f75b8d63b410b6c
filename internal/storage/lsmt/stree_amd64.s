//go:build amd64

#include "textflag.h"

// func search32AVX512(keys *uint32, levels *int, nlevels int, x uint32, ms *Mapping) int
//
// Per level: K1 = lanes of the node with key <= x (VPCMPUD predicate 5,
// "not less than": x >= key), c = popcount(K1), parent = k, k = 17k + c.
// At the leaf level the result is 16k + c. Before the leaf's compare it
// prefetches the 16 mappings that leaf indexes (and the next one): on a
// large index the leaf line and the mapping the caller reads next are both
// cache misses, and this way they overlap instead of following each other.
TEXT ·search32AVX512(SB), NOSPLIT, $0-48
	MOVQ keys+0(FP), SI
	MOVQ levels+8(FP), DI
	MOVQ nlevels+16(FP), CX
	MOVL x+24(FP), AX
	MOVQ ms+32(FP), R11
	VPBROADCASTD AX, Z0
	XORQ BX, BX
	DECQ CX
	JZ   leaf32

loop32:
	MOVQ    BX, R9
	SHLQ    $4, R9
	ADDQ    (DI), R9
	VPCMPUD $5, (SI)(R9*4), Z0, K1
	KMOVW   K1, R10
	POPCNTL R10, R10
	MOVQ    BX, DX
	SHLQ    $4, BX
	ADDQ    DX, BX
	ADDQ    R10, BX
	ADDQ    $8, DI
	DECQ    CX
	JNZ     loop32

leaf32:
	// 16 mappings of 24 bytes: 384 bytes from ms + 384k, plus one more.
	IMUL3Q     $384, BX, R12
	ADDQ       R11, R12
	PREFETCHT0 (R12)
	PREFETCHT0 64(R12)
	PREFETCHT0 128(R12)
	PREFETCHT0 192(R12)
	PREFETCHT0 256(R12)
	PREFETCHT0 320(R12)
	PREFETCHT0 384(R12)
	MOVQ       BX, R9
	SHLQ       $4, R9
	ADDQ       (DI), R9
	VPCMPUD    $5, (SI)(R9*4), Z0, K1
	KMOVW      K1, R10
	POPCNTL    R10, R10
	SHLQ       $4, BX
	ADDQ       R10, BX
	MOVQ       BX, ret+40(FP)
	VZEROUPPER
	RET

// func search64AVX512(keys *uint64, levels *int, nlevels int, x uint64, ms *Mapping) int
//
// As search32AVX512 with 8 lanes: k = 9k + c, leaf result 8k + c, and the
// leaf's 8 mappings are 192 bytes.
TEXT ·search64AVX512(SB), NOSPLIT, $0-48
	MOVQ keys+0(FP), SI
	MOVQ levels+8(FP), DI
	MOVQ nlevels+16(FP), CX
	MOVQ x+24(FP), AX
	MOVQ ms+32(FP), R11
	VPBROADCASTQ AX, Z0
	XORQ BX, BX
	DECQ CX
	JZ   leaf64

loop64:
	MOVQ    BX, R9
	SHLQ    $3, R9
	ADDQ    (DI), R9
	VPCMPUQ $5, (SI)(R9*8), Z0, K1
	KMOVW   K1, R10
	POPCNTL R10, R10
	MOVQ    BX, DX
	SHLQ    $3, BX
	ADDQ    DX, BX
	ADDQ    R10, BX
	ADDQ    $8, DI
	DECQ    CX
	JNZ     loop64

leaf64:
	IMUL3Q     $192, BX, R12
	ADDQ       R11, R12
	PREFETCHT0 (R12)
	PREFETCHT0 64(R12)
	PREFETCHT0 128(R12)
	PREFETCHT0 192(R12)
	MOVQ       BX, R9
	SHLQ       $3, R9
	ADDQ       (DI), R9
	VPCMPUQ    $5, (SI)(R9*8), Z0, K1
	KMOVW      K1, R10
	POPCNTL    R10, R10
	SHLQ       $3, BX
	ADDQ       R10, BX
	MOVQ       BX, ret+40(FP)
	VZEROUPPER
	RET

// GT32AVX2 sets R10 to the number of keys above x (Y0, top bit flipped; Y1 holds
// the flip) in the 16-key node at SI + 4*R9: two signed compares of the flipped
// keys, packed into one byte mask with 2 bits a key.
#define GT32AVX2 \
	VPXOR     (SI)(R9*4), Y1, Y2; \
	VPXOR     32(SI)(R9*4), Y1, Y3; \
	VPCMPGTD  Y0, Y2, Y2; \
	VPCMPGTD  Y0, Y3, Y3; \
	VPACKSSDW Y3, Y2, Y2; \
	VPMOVMSKB Y2, R10; \
	POPCNTL   R10, R10; \
	SHRL      $1, R10

// GT64AVX2 is GT32AVX2 for the 8-key node of uint64 keys at SI + 8*R9 (4 mask
// bits a key).
#define GT64AVX2 \
	VPXOR     (SI)(R9*8), Y1, Y2; \
	VPXOR     32(SI)(R9*8), Y1, Y3; \
	VPCMPGTQ  Y0, Y2, Y2; \
	VPCMPGTQ  Y0, Y3, Y3; \
	VPACKSSDW Y3, Y2, Y2; \
	VPMOVMSKB Y2, R10; \
	POPCNTL   R10, R10; \
	SHRL      $2, R10

// func search32AVX2(keys *uint32, levels *int, nlevels int, x uint32, ms *Mapping) int
//
// search32AVX512 for CPUs with AVX2 only (AMD before Zen 4, most Intel
// client parts). AVX2 compares are signed and have no mask registers, so
// keys and x are compared with their top bit flipped (unsigned order) and a
// node's count is c = 16 - (keys above x), from GT32AVX2.
TEXT ·search32AVX2(SB), NOSPLIT, $0-48
	MOVQ keys+0(FP), SI
	MOVQ levels+8(FP), DI
	MOVQ nlevels+16(FP), CX
	MOVL x+24(FP), AX
	MOVQ ms+32(FP), R11
	MOVL $0x80000000, DX
	XORL DX, AX
	MOVQ AX, X0
	VPBROADCASTD X0, Y0
	MOVQ DX, X1
	VPBROADCASTD X1, Y1
	XORQ BX, BX
	DECQ CX
	JZ   leaf32v2

loop32v2:
	MOVQ BX, R9
	SHLQ $4, R9
	ADDQ (DI), R9
	GT32AVX2
	MOVQ BX, DX
	SHLQ $4, BX
	ADDQ DX, BX
	ADDQ $16, BX
	SUBQ R10, BX
	ADDQ $8, DI
	DECQ CX
	JNZ  loop32v2

leaf32v2:
	IMUL3Q     $384, BX, R12
	ADDQ       R11, R12
	PREFETCHT0 (R12)
	PREFETCHT0 64(R12)
	PREFETCHT0 128(R12)
	PREFETCHT0 192(R12)
	PREFETCHT0 256(R12)
	PREFETCHT0 320(R12)
	PREFETCHT0 384(R12)
	MOVQ       BX, R9
	SHLQ       $4, R9
	ADDQ       (DI), R9
	GT32AVX2
	SHLQ       $4, BX
	ADDQ       $16, BX
	SUBQ       R10, BX
	MOVQ       BX, ret+40(FP)
	VZEROUPPER
	RET

// func search64AVX2(keys *uint64, levels *int, nlevels int, x uint64, ms *Mapping) int
//
// As search32AVX2 with 8 keys of 64 bits a node: c = 8 - GT64AVX2, k = 9k + c.
TEXT ·search64AVX2(SB), NOSPLIT, $0-48
	MOVQ keys+0(FP), SI
	MOVQ levels+8(FP), DI
	MOVQ nlevels+16(FP), CX
	MOVQ x+24(FP), AX
	MOVQ ms+32(FP), R11
	MOVQ $0x8000000000000000, DX
	XORQ DX, AX
	MOVQ AX, X0
	VPBROADCASTQ X0, Y0
	MOVQ DX, X1
	VPBROADCASTQ X1, Y1
	XORQ BX, BX
	DECQ CX
	JZ   leaf64v2

loop64v2:
	MOVQ BX, R9
	SHLQ $3, R9
	ADDQ (DI), R9
	GT64AVX2
	MOVQ BX, DX
	SHLQ $3, BX
	ADDQ DX, BX
	ADDQ $8, BX
	SUBQ R10, BX
	ADDQ $8, DI
	DECQ CX
	JNZ  loop64v2

leaf64v2:
	IMUL3Q     $192, BX, R12
	ADDQ       R11, R12
	PREFETCHT0 (R12)
	PREFETCHT0 64(R12)
	PREFETCHT0 128(R12)
	PREFETCHT0 192(R12)
	MOVQ       BX, R9
	SHLQ       $3, R9
	ADDQ       (DI), R9
	GT64AVX2
	SHLQ       $3, BX
	ADDQ       $8, BX
	SUBQ       R10, BX
	MOVQ       BX, ret+40(FP)
	VZEROUPPER
	RET
