"""`python -m simadmit.calibrate ...`: the calibrate command without the `simadmit` entry point."""

from simadmit.calibrate.cli import calibrate_app

calibrate_app(prog_name="simadmit calibrate")
