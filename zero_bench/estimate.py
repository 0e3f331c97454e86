def seed_micro(cfg):
    return None
