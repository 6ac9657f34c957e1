"""Pure policy: every scheduling and scaling decision as a function of a snapshot.

Nothing here imports redis or reads a clock: time is an argument. The
dispatcher, the scaler and the simulator all call these same functions.
"""
