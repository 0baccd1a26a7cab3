"""The package's methods inside inseq: registered attribution methods and inseq's JSON export.
"""
