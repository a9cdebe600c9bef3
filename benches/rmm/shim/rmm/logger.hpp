// Found before RMM's own `rmm/logger.hpp` (the shim folder comes first on the include path):
// RMM's logging macros as no-ops, its levels, and a default logger that drops messages.
#pragma once

#include <rapids_logger/logger.hpp>
#include <rmm/detail/export.hpp>

#define RMM_LOG_LEVEL_TRACE    0
#define RMM_LOG_LEVEL_DEBUG    1
#define RMM_LOG_LEVEL_INFO     2
#define RMM_LOG_LEVEL_WARN     3
#define RMM_LOG_LEVEL_ERROR    4
#define RMM_LOG_LEVEL_CRITICAL 5
#define RMM_LOG_LEVEL_OFF      6
#ifndef RMM_LOG_ACTIVE_LEVEL
#define RMM_LOG_ACTIVE_LEVEL RMM_LOG_LEVEL_OFF
#endif

#define RMM_LOG_TRACE(...)    (void)0
#define RMM_LOG_DEBUG(...)    (void)0
#define RMM_LOG_INFO(...)     (void)0
#define RMM_LOG_WARN(...)     (void)0
#define RMM_LOG_ERROR(...)    (void)0
#define RMM_LOG_CRITICAL(...) (void)0

namespace RMM_NAMESPACE {

inline rapids_logger::logger& default_logger()
{
  static rapids_logger::logger logger{"RMM", ""};
  return logger;
}

}  // namespace RMM_NAMESPACE
