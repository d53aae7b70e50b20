"""A doctest unit test: the test sources plus the shared doctest main."""

def doctest_test(name, srcs, deps = [], **kwargs):
    native.cc_test(
        name = name,
        srcs = srcs,
        deps = deps + ["//tests:doctest_main", "@system//:doctest"],
        **kwargs
    )
