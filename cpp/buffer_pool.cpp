#include "buffer_pool.hpp"

#include <cstdlib>
#include <mutex>
#include <new>
#include <unordered_map>

namespace attnpp {
namespace {

constexpr std::size_t kHeader = 64;                    // holds the block's size; keeps the data 64-byte aligned
constexpr std::size_t kPoolBytes = std::size_t(256) << 20;  // most memory kept for reuse

struct Pool {
  std::mutex mutex;
  std::unordered_multimap<std::size_t, char*> free_blocks;  // size -> block (header included)
  std::size_t held_bytes = 0;
};

// Never destroyed: blocks come back from thread_local buffers (the products' packed operands) when their threads
// end, and LLVM's libomp ends its threads at exit, after the static objects' destructors have run (a pool that
// was a static object then crashed the process: tools/cross_check.sh's test built by Clang).
Pool& pool() {
  static Pool* const p = new Pool;
  return *p;
}

// (pool().mutex held)
std::size_t empty_locked(Pool& p) {
  for (const auto& entry : p.free_blocks) std::free(entry.second);
  p.free_blocks.clear();
  const std::size_t freed = p.held_bytes;
  p.held_bytes = 0;
  return freed;
}

}  // namespace

void* pool_acquire(std::size_t bytes) {
  {
    Pool& p = pool();
    std::lock_guard<std::mutex> lock(p.mutex);
    const auto it = p.free_blocks.find(bytes);
    if (it != p.free_blocks.end()) {
      char* block = it->second;
      p.free_blocks.erase(it);
      p.held_bytes -= bytes;
      return block + kHeader;
    }
  }
  const std::size_t total = (kHeader + bytes + 63) / 64 * 64;
  if (total < bytes) throw std::bad_alloc();  // overflow
  char* block = static_cast<char*>(std::aligned_alloc(64, total));
  if (block == nullptr) throw std::bad_alloc();
  *reinterpret_cast<std::size_t*>(block) = bytes;
  return block + kHeader;
}

void pool_release(void* data) {
  char* block = static_cast<char*>(data) - kHeader;
  const std::size_t bytes = *reinterpret_cast<std::size_t*>(block);
  if (bytes <= kPoolBytes) {
    Pool& p = pool();
    std::lock_guard<std::mutex> lock(p.mutex);
    // Full: drop what is kept (sizes of an earlier workload, which would otherwise lock out the current one).
    if (p.held_bytes + bytes > kPoolBytes) empty_locked(p);
    p.free_blocks.emplace(bytes, block);
    p.held_bytes += bytes;
    return;
  }
  std::free(block);
}

std::size_t pool_empty() {
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  return empty_locked(p);
}

}  // namespace attnpp
