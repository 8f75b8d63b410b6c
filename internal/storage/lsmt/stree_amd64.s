//go:build amd64

#include "textflag.h"

// func search32AVX512(keys *uint32, levels *int, nlevels int, x uint32) int
//
// Per level: K1 = lanes of the node with key <= x (VPCMPUD predicate 5,
// "not less than": x >= key), c = popcount(K1), parent = k, k = 17k + c.
// Returns k - parent, the position in the leaf level.
TEXT ·search32AVX512(SB), NOSPLIT, $0-40
	MOVQ keys+0(FP), SI
	MOVQ levels+8(FP), DI
	MOVQ nlevels+16(FP), CX
	MOVL x+24(FP), AX
	VPBROADCASTD AX, Z0
	XORQ BX, BX
	XORQ DX, DX

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

	SUBQ DX, BX
	MOVQ BX, ret+32(FP)
	VZEROUPPER
	RET

// func search64AVX512(keys *uint64, levels *int, nlevels int, x uint64) int
//
// As search32AVX512 with 8 lanes: k = 9k + c.
TEXT ·search64AVX512(SB), NOSPLIT, $0-40
	MOVQ keys+0(FP), SI
	MOVQ levels+8(FP), DI
	MOVQ nlevels+16(FP), CX
	MOVQ x+24(FP), AX
	VPBROADCASTQ AX, Z0
	XORQ BX, BX
	XORQ DX, DX

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

	SUBQ DX, BX
	MOVQ BX, ret+32(FP)
	VZEROUPPER
	RET
