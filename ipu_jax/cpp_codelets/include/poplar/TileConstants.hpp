// poplar/TileConstants.hpp for ipu-jax's host build of C++ codelets.
//
// Written here, for ipu-jax; no Graphcore code or header is copied. In the
// Poplar SDK this header gives vertex code the constants of the tile's
// architecture. What codelets written for the IPU read from it on the path
// that runs off the IPU (`__IPU__` undefined, the IPUModel's host build,
// which is the one built here) is the number of worker contexts:
//
// * `CTXT_WORKERS`: the worker threads a tile runs, 6 (IPU datasheets and
//   the Poplar and PopLibs user guide: "each tile ... six hardware worker
//   threads", the hardware's barrel scheduling of six contexts; PopLibs'
//   codelets split a vector's work into CTXT_WORKERS parts with it). The
//   same figure is `poplar::Vertex::numWorkers()` (poplar/Vertex.hpp) and
//   `IPUTarget.worker_contexts` (kernels/target.py).
//
// Files that include it only to build on the IPU (pyscf-ipu's
// `nanoDFT/compute_indices.cpp`, `intor_int2e_sph.cpp`,
// `electron_repulsion/int2e_sph.cpp`) use nothing from it on the host path.
// The IPU's control-register indices and masks (`CSR_*`) and memory-map
// addresses (`TMEM_*`) the header also describes are read only by assembly
// and `__IPU__` code, which a host build does not compile, so they are not
// declared. The tile count is not a tile constant: it is the target's
// (1,472 tiles per ipu2 / Bow IPU, datasheet; `IPUTarget.tiles_per_ipu`),
// and Poplar code asks the target for it.
#pragma once

#ifndef CTXT_WORKERS
#define CTXT_WORKERS (6)
#endif
