# The debug switch of the compiled data path (see debug.h; uvloop's debug.pxd).
cdef extern from "debug.h":
    const bint LLMGW_DEBUG
