"""Floor 5, measurement: calibration (acceptance vectors, t(n), draft cost), cached device profiles and the
simulator's view of them (profiles), and task=measure (measure). The top floor: imports every floor below."""
