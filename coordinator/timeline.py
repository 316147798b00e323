"""timeline.py: moved to cli/timeline.py (rendering is presentation, and presentation is cli/).

A re-export kept only until its last two importers, cli/sim.py and tests/coordinator/test_sim.py,
import gyre.cli.timeline; then delete this file. Nothing in coordinator/ imports it.
"""

from gyre.cli.timeline import result_from_metrics, role_timeline_svg, role_timeline_text, time_axis  # noqa: F401
