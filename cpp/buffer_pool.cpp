#include "buffer_pool.hpp"

#include <cstdlib>
#include <mutex>
#include <new>
#include <unordered_map>

namespace attnpp {
namespace {

constexpr std::size_t kHeader = 64;                    // holds the block's size; keeps the data 64-byte aligned
constexpr std::size_t kPoolBytes = std::size_t(256) << 20;  // most memory kept for reuse

std::mutex pool_mutex;
std::unordered_multimap<std::size_t, char*> free_blocks;  // size -> block (header included)
std::size_t held_bytes = 0;

// (pool_mutex held)
std::size_t empty_locked() {
  for (const auto& entry : free_blocks) std::free(entry.second);
  free_blocks.clear();
  const std::size_t freed = held_bytes;
  held_bytes = 0;
  return freed;
}

}  // namespace

void* pool_acquire(std::size_t bytes) {
  {
    std::lock_guard<std::mutex> lock(pool_mutex);
    const auto it = free_blocks.find(bytes);
    if (it != free_blocks.end()) {
      char* block = it->second;
      free_blocks.erase(it);
      held_bytes -= bytes;
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
    std::lock_guard<std::mutex> lock(pool_mutex);
    // Full: drop what is kept (sizes of an earlier workload, which would otherwise lock out the current one).
    if (held_bytes + bytes > kPoolBytes) empty_locked();
    free_blocks.emplace(bytes, block);
    held_bytes += bytes;
    return;
  }
  std::free(block);
}

std::size_t pool_empty() {
  std::lock_guard<std::mutex> lock(pool_mutex);
  return empty_locked();
}

}  // namespace attnpp
