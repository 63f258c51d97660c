#!/bin/sh
echo "coverage_report_generator: not available in the offline build (stand-in repository)" >&2
exit 1
