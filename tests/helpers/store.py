"""A store file as an earlier raytron wrote it, for the migration tests."""

from __future__ import annotations

V1_SQLITE = """
CREATE TABLE jobs (number INTEGER NOT NULL, id VARCHAR(128) NOT NULL, name VARCHAR(256) NOT NULL,
    spec JSON NOT NULL, priority INTEGER NOT NULL, state VARCHAR(16) NOT NULL, submitted_at DOUBLE NOT NULL,
    updated_at DOUBLE NOT NULL, ray_job_id VARCHAR(128), error JSON, sizes JSON, iteration INTEGER NOT NULL,
    PRIMARY KEY (number), UNIQUE (id));
CREATE INDEX ix_jobs_state ON jobs (state);
CREATE TABLE schema_version (version INTEGER NOT NULL);
CREATE TABLE events (job_id VARCHAR(128) NOT NULL, seq INTEGER NOT NULL, time DOUBLE NOT NULL,
    kind VARCHAR(32) NOT NULL, state VARCHAR(16) NOT NULL, message TEXT NOT NULL, data JSON,
    PRIMARY KEY (job_id, seq), FOREIGN KEY(job_id) REFERENCES jobs (id) ON DELETE CASCADE);
CREATE TABLE attempts (job_id VARCHAR(128) NOT NULL, number INTEGER NOT NULL, started_at DOUBLE NOT NULL,
    ended_at DOUBLE, reason TEXT, from_checkpoint TEXT, PRIMARY KEY (job_id, number),
    FOREIGN KEY(job_id) REFERENCES jobs (id) ON DELETE CASCADE);
CREATE TABLE metrics (job_id VARCHAR(128) NOT NULL, iteration INTEGER NOT NULL, data JSON NOT NULL,
    PRIMARY KEY (job_id, iteration), FOREIGN KEY(job_id) REFERENCES jobs (id) ON DELETE CASCADE);
INSERT INTO schema_version VALUES (1);
INSERT INTO jobs VALUES (1, 'old-1', 'old', '{}', 0, 'RUNNING', 1.0, 2.0, NULL, NULL, NULL, 2);
INSERT INTO events VALUES ('old-1', 1, 1.0, 'state', 'QUEUED', 'submitted', '{}');
INSERT INTO events VALUES ('old-1', 2, 1.5, 'iteration', 'RUNNING', '', '{"iteration": 1, "loss": 5.0}');
INSERT INTO events VALUES ('old-1', 3, 1.6, 'iteration', 'RUNNING', '', '{"iteration": 2, "loss": 4.0, "lr": 0.1}');
INSERT INTO metrics VALUES ('old-1', 1, '{"iteration": 1, "loss": 5.0}');
INSERT INTO metrics VALUES ('old-1', 2, '{"iteration": 2, "loss": 4.0, "lr": 0.1}');
INSERT INTO metrics VALUES ('old-1', 3, '{"iteration": 3, "loss": 3.0, "tokens_per_s": 7.0}');
"""
