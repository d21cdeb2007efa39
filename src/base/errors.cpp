#include "mnist_ddp/base/errors.hpp"

#include <c10/util/Exception.h>

namespace mnist_ddp {

std::string error_line(const std::exception& e) {
  std::string msg = e.what();
  if (const auto* c10e = dynamic_cast<const c10::Error*>(&e)) msg = c10e->what_without_backtrace();
  return msg.substr(0, msg.find('\n'));
}

}  // namespace mnist_ddp
