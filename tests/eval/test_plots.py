"""Colours of the method plots: distinct per method."""


def test_method_colors_are_distinct_up_to_twenty_methods():
    from matplotlib.colors import to_rgb

    from kvlearn.eval.plots import method_colors

    for n in (3, 10, 11, 20):
        colors = method_colors([f"m{i}" for i in range(n)])
        assert len({to_rgb(c) for c in colors.values()}) == n
