/* LLMGW_DEBUG: 1 in the debug build (setup.py: LLMGW_DEBUG_BUILD=1), else 0.
 * The data path's invariant checks and live-object counters sit under
 * `if LLMGW_DEBUG:` and compile out of release builds. */
#ifndef LLMGW_DEBUG
#define LLMGW_DEBUG 0
#endif
