// Stands in for rapids-logger (a compiled library RMM's headers name), which the GPU machine
// does not have: RMM's memory resources only log, so a logger that drops every message
// leaves their allocation paths as they are (RMM's own logging is compiled out in release
// builds as well).
#pragma once

#include <memory>
#include <string>
// RMM's headers use std::vector without including it: the real logger brings it.
#include <vector>

namespace rapids_logger {

enum class level_enum { trace, debug, info, warn, error, critical, off };

struct sink {};
using sink_ptr = std::shared_ptr<sink>;

class logger {
 public:
  logger(std::string const&, std::string const&) {}
  template <class... Args>
  void trace(Args&&...)
  {
  }
  template <class... Args>
  void debug(Args&&...)
  {
  }
  template <class... Args>
  void info(Args&&...)
  {
  }
  template <class... Args>
  void warn(Args&&...)
  {
  }
  void set_level(level_enum) {}
  void flush() {}
};

}  // namespace rapids_logger
