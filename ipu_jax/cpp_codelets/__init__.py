"""C++ codelets (Poplar vertex code) compiled for the host and run through XLA FFI.

::

    from ipu_jax import cpp_codelets
    lib = cpp_codelets.compile_codelets("codelets.cpp")   # cached by content hash
    lib.vertex_classes["SumVertex"].fields                 # Field(name, kind, shape, dtype)
    outs = cpp_codelets.run_vertices(lib, "SumVertex",
                                     [{"in": x0, "out": o0}, {"in": x1, "out": o1}])

In the graph API, ``Graph.add_codelets(path_or_source)`` registers every
vertex class and ``Graph.add_vertex(cs, "SumVertex", tile=0, in_=..., ...)``
places one. See docs/cpp_codelets.md.
"""

from ipu_jax.cpp_codelets.build import (CodeletCompileError, CodeletLibrary, Field,
                                        VertexClass, compile_codelets)
from ipu_jax.cpp_codelets.run import run_vertices, vertex_function

__all__ = ["CodeletCompileError", "CodeletLibrary", "Field", "VertexClass",
           "compile_codelets", "run_vertices", "vertex_function"]
