#pragma once
// The job types in one include: request, events, result, cancellation, model family.
#include "core/job/cancel.h"
#include "core/job/events.h"
#include "core/job/model_family.h"
#include "core/job/request.h"
#include "core/job/result.h"
