#include "agent/coordinator/wire_checks.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"

namespace elrun::rdzv {
namespace {

constexpr int64_t kMaxWorld = 65536LL * 4096;  // The coordinator's limits: nodes x nproc.

bool IsLabelChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
}

bool IsHostName(absl::string_view text) {
  if (text.empty() || text.size() > 253) return false;
  size_t start = 0;
  while (start <= text.size()) {
    size_t dot = text.find('.', start);
    absl::string_view label =
        text.substr(start, dot == absl::string_view::npos ? absl::string_view::npos : dot - start);
    if (label.empty() || label.size() > 63 || label.front() == '-' || label.back() == '-') return false;
    for (char c : label) {
      if (!IsLabelChar(c)) return false;
    }
    if (dot == absl::string_view::npos) return true;
    start = dot + 1;
  }
  return false;  // A trailing dot.
}

absl::Status Field(absl::string_view name, int64_t value, int64_t min, int64_t max) {
  if (value >= min && value <= max) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(std::string(name), " = ", value, " is outside [", min, ", ", max, "]"));
}

// The code point of the UTF-8 sequence at text[i] and its length; length 0 when invalid.
std::pair<uint32_t, size_t> DecodeUtf8(absl::string_view text, size_t i) {
  auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  unsigned char lead = byte(i);
  size_t length = lead >= 0xF0 && lead <= 0xF4 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC2 && lead < 0xE0 ? 2 : 0;
  if (length == 0 || i + length > text.size()) return {0, 0};
  uint32_t cp = lead & (0x7F >> length);
  for (size_t k = 1; k < length; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return {0, 0};
    cp = (cp << 6) | (byte(i + k) & 0x3F);
  }
  bool overlong = (length == 3 && cp < 0x800) || (length == 4 && cp < 0x10000);
  if (overlong || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return {0, 0};
  return {cp, length};
}

bool IsUnsafeCodePoint(uint32_t cp) {
  return (cp >= 0x80 && cp <= 0x9F) ||                    // C1 controls.
         cp == 0x200E || cp == 0x200F ||                  // Directional marks.
         (cp >= 0x2028 && cp <= 0x202E) ||                // Line breaks, bidi embeddings.
         (cp >= 0x2066 && cp <= 0x2069) || cp == 0xFEFF;  // Bidi isolates, BOM.
}

}  // namespace

bool IsHostOrAddress(absl::string_view text) {
  if (text.empty() || text.size() > 253) return false;
  // Only printable ASCII: inet_pton reads up to a NUL, so "10.0.0.1\0<anything>" parsed as an
  // address, and whatever followed the NUL reached other nodes' consoles.
  for (char c : text) {
    if (c <= 0x20 || c >= 0x7F) return false;
  }
  std::string copy(text);
  unsigned char buffer[16];
  if (inet_pton(AF_INET, copy.c_str(), buffer) == 1) return true;
  if (inet_pton(AF_INET6, copy.c_str(), buffer) == 1) return true;
  // All-numeric dotted names ("1.2.3") are not hosts but malformed addresses.
  if (copy.find_first_not_of("0123456789.") == std::string::npos) return false;
  return IsHostName(text);
}

absl::Status CheckHostOrAddress(absl::string_view what, absl::string_view value) {
  if (IsHostOrAddress(value)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(std::string(what), " '", EscapeForConsole(value, 64), "' is not a host name or an IP address"));
}

absl::Status ValidateRoundStarted(const v1::RoundStarted& r, const RoundExpectations& e) {
  if (r.round() <= e.last_round) {
    return absl::InvalidArgumentError(absl::StrCat("round = ", r.round(), " is not after round ", e.last_round));
  }
  const int64_t world = r.world_size();
  for (absl::Status s :
       {Field("group_world_size", r.group_world_size(), e.min_nodes, e.max_nodes),
        Field("group_rank", r.group_rank(), 0, r.group_world_size() - 1),
        Field("world_size", world, std::max<int64_t>(e.nproc, r.group_world_size()), kMaxWorld),
        Field("rank_offset", r.rank_offset(), 0, world - e.nproc),
        Field("role_world_size", r.role_world_size(), e.nproc, world),
        Field("role_rank_offset", r.role_rank_offset(), 0, r.role_world_size() - e.nproc),
        Field("master_port", r.master_port(), 1, 65535), Field("restart_count", r.restart_count(), 0, e.max_restarts),
        CheckHostOrAddress("master_addr", r.master_addr())}) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

std::string EscapeForConsole(absl::string_view text, size_t max_bytes) {
  bool cut = text.size() > max_bytes;
  if (cut) text = text.substr(0, max_bytes);
  std::string out;
  out.reserve(text.size());
  char buffer[16];
  for (size_t i = 0; i < text.size();) {
    unsigned char c = static_cast<unsigned char>(text[i]);
    if (c == '\\') {
      out += "\\\\";
      ++i;
    } else if (c >= 0x20 && c < 0x7F) {
      out += static_cast<char>(c);
      ++i;
    } else if (c < 0x80) {
      const char* named = c == '\n' ? "\\n" : c == '\r' ? "\\r" : c == '\t' ? "\\t" : nullptr;
      if (named == nullptr) {
        std::snprintf(buffer, sizeof(buffer), "\\x%02x", c);
        named = buffer;
      }
      out += named;
      ++i;
    } else {
      auto [cp, length] = DecodeUtf8(text, i);
      if (length == 0) {
        std::snprintf(buffer, sizeof(buffer), "\\x%02x", c);
        out += buffer;
        ++i;
      } else if (IsUnsafeCodePoint(cp)) {
        std::snprintf(buffer, sizeof(buffer), "\\u{%04x}", cp);
        out += buffer;
        i += length;
      } else {
        out.append(text.data() + i, length);
        i += length;
      }
    }
  }
  if (cut) out += "...";
  return out;
}

}  // namespace elrun::rdzv
