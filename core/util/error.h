#pragma once
#include <stdexcept>
#include <string>

namespace diffract {

// Every error the core reports to a user. The message names the thing that is wrong
// (file, tensor, key, option) so it can be shown as is.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace diffract
