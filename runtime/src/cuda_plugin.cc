// Opens libmemplan_cuda.so (cuda_plugin.h).
#include "memplan/runtime/cuda_plugin.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

namespace memplan::runtime {
namespace {

std::string ExecutableDir() {
  std::vector<char> buf(4096);
  ssize_t n = ::readlink("/proc/self/exe", buf.data(), buf.size() - 1);
  if (n <= 0) return {};
  std::string path(buf.data(), static_cast<size_t>(n));
  auto slash = path.rfind('/');
  return slash == std::string::npos ? std::string() : path.substr(0, slash);
}

Expected<const CudaPlugin*> Open() {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("MEMPLAN_CUDA_PLUGIN"); env && *env) {
    candidates.push_back(env);
  } else {
    if (std::string dir = ExecutableDir(); !dir.empty()) {
      candidates.push_back(dir + "/" + kCudaPluginFile);
      candidates.push_back(dir + "/../" MEMPLAN_PLUGIN_LIBDIR "/" + kCudaPluginFile);
    }
    candidates.push_back(kCudaPluginFile);  // the dynamic linker's path
  }
  std::string tried;
  for (const std::string& path : candidates) {
    void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
      const char* why = ::dlerror();
      tried += (tried.empty() ? "" : "; ") + std::string(why ? why : path.c_str());
      continue;
    }
    auto entry = reinterpret_cast<const CudaPlugin* (*)()>(::dlsym(handle, kCudaPluginSymbol));
    const CudaPlugin* plugin = entry ? entry() : nullptr;
    if (!plugin || plugin->abi != kCudaPluginAbi || std::string(plugin->version ? plugin->version : "") != MEMPLAN_VERSION) {
      ::dlclose(handle);
      return Error{ErrorCode::kRuntime, path + ": not a CUDA plugin of memplan " MEMPLAN_VERSION
                                               " (rebuild it with this memplan)"};
    }
    return plugin;  // never closed: the backend's code lives in it
  }
  return Error{ErrorCode::kRuntime,
               "--backend cuda: cannot load the CUDA plugin (" + tried +
                   "); memplan built without CUDA has none (configure with -Dcuda=enabled)"};
}

}  // namespace

Expected<const CudaPlugin*> LoadCudaPlugin() {
  static std::once_flag once;
  static Expected<const CudaPlugin*> loaded = Error{ErrorCode::kRuntime, "unreachable"};
  std::call_once(once, [] { loaded = Open(); });
  return loaded;
}

}  // namespace memplan::runtime
