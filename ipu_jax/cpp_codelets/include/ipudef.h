// ipudef.h for ipu-jax's host build of C++ codelets.
//
// Written here, for ipu-jax, from the documented semantics of the IPU
// intrinsics vertex code uses; no Graphcore code or header is copied. These
// are the host fallbacks, as an IPUModel build sees them (`__IPU__` is not
// defined, so code guarded by it takes its model path):
//
// * `__builtin_ipu_get_scount_l/u`: the tile's cycle counter, low and high
//   words. The emulator prices vertices at lowering time, not while they
//   run, so on the host the counter reads as 0: differences of it are 0.
// * `__builtin_assume(cond)`: a hint to the optimiser (clang's builtin);
//   here it evaluates nothing.
#pragma once

#include <cstdint>

inline unsigned __builtin_ipu_get_scount_l() { return 0u; }
inline unsigned __builtin_ipu_get_scount_u() { return 0u; }

#ifndef __clang__
#define __builtin_assume(cond) ((void)0)
#endif
