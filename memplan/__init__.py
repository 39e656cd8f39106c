from memplan.errors import *  # placeholder until the API lands
