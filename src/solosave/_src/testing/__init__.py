"""Test doubles shared by the tests and the benchmarks; the library never imports them."""
