"""The error a user can fix by changing the config: reported in one line, before anything heavy runs. Its own
module, so that every stage (the config's checks, a profile's conventions, a method's knobs) raises it without
importing another."""


class ConfigError(ValueError):
    """A user-fixable config problem; the message names the offending value and what would do."""
