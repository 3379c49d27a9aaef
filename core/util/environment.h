#pragma once
// Variables of the environment that are not Diffract's own (HF_HUB_CACHE, HF_HOME, HOME,
// XDG_CONFIG_HOME): where other tools keep their files. Defined beside the options table
// (options.cpp), the one place in core that reads the environment; kept out of options.h, which
// the job types (and so nearly every file) include.
#include <string>

namespace diffract::options {

// The variable's value; "" when it is unset.
std::string environment(const char* name);

}  // namespace diffract::options
