// The text of /salus/README: a short usage guide readable with cat.
#pragma once

#include <string>

namespace salus::fusefs {
const std::string& readme_text();
}
