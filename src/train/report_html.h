// `meshtrain report`: one self-contained HTML page (inline data, SVG drawn by inline script; no
// network) of one or more runs' metrics, overlaid: loss and validation loss, tokens/s, MFU, step
// time and exposed communication, data wait, peak memory per step, memory by category and bytes by
// group (the final objects), a per-rank step-time heat map when the steps record `step_ms_per_rank`,
// and per run its layout, config and diagnosis (train/report_diagnose.h).
#pragma once
#include <string>
#include <vector>

#include "train/report_data.h"
#include "train/report_diagnose.h"

namespace mt {

struct ReportRun {
  RunMetrics metrics;
  Diagnosis diagnosis;
  std::string config_text;  // the run's config (empty: not given)
};

std::string report_html(const std::vector<ReportRun>& runs, const std::string& title);

}  // namespace mt
