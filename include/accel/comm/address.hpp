#pragma once
// NOTE [Which address a rank advertises]
// Gloo binds each rank to one address and tells the other ranks to connect
// to it. PyTorch's default is the address this host's name resolves to,
// which in most containers is 127.0.0.1: a rank on a second machine then
// gets "Connection refused". accel instead takes the address through which
// this machine reaches MASTER_ADDR (the kernel's choice for a UDP socket
// connected there, which sends nothing), so several machines work with no
// variable set. GLOO_SOCKET_IFNAME still wins, as in PyTorch. A rank that
// would advertise a loopback address while ranks run on other machines
// (and MASTER_ADDR is not itself a loopback address, which would put every
// machine on this host) is refused by name (GlooAdapter::device_for, comm/gloo_adapter.hpp), as
// when MASTER_ADDR is this host's name and that resolves to 127.0.1.1.
// Torch-free.

#include <optional>
#include <string>

#include "accel/core/compiled_once.hpp"

namespace accel::comm {

/// This machine's address on the route to `host:port`; nothing when `host`
/// does not resolve or there is no route.
std::optional<std::string> local_address_towards(const std::string& host, int port);

/// The first IPv4 (else IPv6) address of network interface `name`.
std::optional<std::string> interface_address(const std::string& name);

/// 127.0.0.0/8 or ::1.
inline bool is_loopback_address(const std::string& address) {
  return address.rfind("127.", 0) == 0 || address == "::1";
}

// The functions compiled once (NOTE [Compiled once]).
#if ACCEL_DEFINE_COMPILED_ONCE
}  // namespace accel::comm

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace accel::comm {

namespace detail {
inline std::optional<std::string> numeric_host(const sockaddr* address) {
  char text[INET6_ADDRSTRLEN] = {};
  const void* raw = address->sa_family == AF_INET
                        ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(address)->sin_addr)
                        : static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(address)->sin6_addr);
  if (::inet_ntop(address->sa_family, raw, text, sizeof(text)) == nullptr) return std::nullopt;
  return std::string(text);
}
}  // namespace detail

// ACCEL_COMPILED_ONCE_DEFINITIONS
ACCEL_COMPILED_ONCE std::optional<std::string> local_address_towards(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return std::nullopt;
  std::optional<std::string> address;
  for (addrinfo* a = found; a != nullptr && !address; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, SOCK_DGRAM, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t length = sizeof(local);
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0)
      address = detail::numeric_host(reinterpret_cast<const sockaddr*>(&local));
    ::close(fd);
  }
  ::freeaddrinfo(found);
  return address;
}

ACCEL_COMPILED_ONCE std::optional<std::string> interface_address(const std::string& name) {
  ifaddrs* all = nullptr;
  if (::getifaddrs(&all) != 0) return std::nullopt;
  std::optional<std::string> v4, v6;
  for (ifaddrs* i = all; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || name != i->ifa_name) continue;
    if (i->ifa_addr->sa_family == AF_INET && !v4) v4 = detail::numeric_host(i->ifa_addr);
    if (i->ifa_addr->sa_family == AF_INET6 && !v6) v6 = detail::numeric_host(i->ifa_addr);
  }
  ::freeifaddrs(all);
  return v4 ? v4 : v6;
}

#endif

}  // namespace accel::comm
