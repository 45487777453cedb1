"""How an asset is defined: the decorators, their arguments, the function's signature, asset checks
and the Component.
"""
