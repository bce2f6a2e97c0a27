// Recycled memory for large output arrays.
//
// Memory fresh from the operating system costs a page fault per 4 KiB page on first touch. Article 001's model
// allocates its logits and their gradient (4.8 MB each) anew at every training step; through malloc, which hands
// such blocks back to the system when they are freed, that was about 1,700 page faults per step, most of a 2.5 ms
// step. Blocks released here are kept (up to 256 MiB in all; when full, what is kept is dropped for the newest)
// and handed out again for a request of the same size.
#pragma once

#include <cstddef>
#include <memory>

namespace attnpp {

// A 64-byte aligned block of `bytes`, recycled if one of that size was released; std::bad_alloc when the
// system has no memory left.
void* pool_acquire(std::size_t bytes);

// Gives back a block from pool_acquire.
void pool_release(void* block);

// Frees every block kept for reuse; returns their bytes.
std::size_t pool_empty();

// Gives a block back to the pool when its owner goes (the deleter of PoolArray).
struct PoolRelease {
  void operator()(void* block) const { pool_release(block); }
};

// An uninitialized array of n T from the pool, returned to it when it goes out of scope.
template <typename T>
using PoolArray = std::unique_ptr<T[], PoolRelease>;
template <typename T>
PoolArray<T> pool_array(std::size_t n) {
  return PoolArray<T>(static_cast<T*>(pool_acquire(n * sizeof(T))));
}

}  // namespace attnpp
