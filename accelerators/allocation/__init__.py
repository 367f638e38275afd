"""Pure allocation logic: no Django imports, `Decimal` and integer base units, typed errors.

Every resource counter the scheduler writes is computed here (Backend.AI's rule: no
resource counter is changed outside the allocation module).
"""
