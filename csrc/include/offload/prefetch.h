// Asking for cache lines ahead of their use, for loops over thousands of Python
// objects and tensors that are cache misses after a training step touched other
// memory: asked for a few items early, the misses of several items overlap
// instead of queueing one after another.
#pragma once

namespace offload {

// Asks for the cache line at `p`. A prefetch never faults, so a stale or invalid
// address costs nothing but the request.
inline void prefetch(const void* p) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p);
#else
  (void)p;
#endif
}

}  // namespace offload
