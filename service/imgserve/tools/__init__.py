"""Side tools of the `imgserve` command, each run in its own process, apart from any server: `train` rebuilds the
built-in model's weights, `plan` replays a load profile through the chart's autoscaling. May import: models and the
shared top-level modules.
"""
