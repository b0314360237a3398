// print.h for ipu-jax's host build of C++ codelets.
//
// Written here, for ipu-jax, from the documented behaviour of the vertex
// `printf` Poplar provides (formatted text to the host's standard output,
// which the IPUModel prints directly); no Graphcore code or header is
// copied. On the host it is the C library's printf.
#pragma once

#include <cstdio>
