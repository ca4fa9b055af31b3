// Small helpers for the JSON lines Tandem writes by hand (progress files,
// --json output), where a library would be more than the job needs.
#pragma once

#include <string>
#include <string_view>

namespace tandem {

// A JSON string literal of `s` (quotes, backslashes and control characters escaped).
std::string JsonQuote(std::string_view s);

}  // namespace tandem
