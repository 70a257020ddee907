#pragma once
// Debian's doctest-dev installs <doctest/doctest.h>; doctest's own meson
// build (the subprojects/doctest.wrap fallback) exposes <doctest.h>.
#if __has_include(<doctest/doctest.h>)
#include <doctest/doctest.h>
#else
#include <doctest.h>
#endif
